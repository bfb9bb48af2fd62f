package udp

import "golang.org/x/sys/unix"

// loopIO is the I/O of one loop (a shard): the readiness of its sockets (the listening socket
// and its sessions' connected sockets) and the datagrams moved on them, a batch per system call
// where the kernel allows. The loop's logic runs on top of it (loop.go: sessions, picks,
// replies from the listening socket, accounting); epollIO (epoll.go: a level-triggered epoll
// set, recvmmsg and sendmmsg) is its one implementation, and an io_uring one would land beside
// it. Only the loop's goroutine calls it, but for wake, which any goroutine may call, and close,
// once no loop runs.
type loopIO interface {
	// add watches fd for datagrams; remove stops watching it (it stays open); closeSocket
	// stops watching fd and closes it.
	add(fd int) error
	remove(fd int) error
	closeSocket(fd int) error
	// wait blocks until a watched socket is readable or wake was called, and returns the
	// readable ones (none when only woken). Level-triggered: a socket with datagrams left after
	// a read is returned again by the next wait.
	wait() (ready []int32, err error)
	// wake makes a wait in progress, or the next one, return.
	wake()
	// recvBatch readies slots [from, to) of m (with the source address and packet info when
	// fromListener) and reads up to to-from datagrams from fd into them; it returns how many.
	recvBatch(fd int, m *msgs, from, to int, fromListener bool) (int, error)
	// sendBatch sends the datagrams hs describe from fd and returns how many left; it fails
	// only when the first one fails.
	sendBatch(fd int, hs []unix.Mmsghdr) (int, error)
	// send writes one datagram to the connected socket fd.
	send(fd int, data []byte) error
	// close releases the loop's own descriptors. No wait may be in progress or follow.
	close() error
}
