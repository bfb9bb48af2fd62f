package transparent

type Support struct {
	Bridge bool
	Reason string
}
