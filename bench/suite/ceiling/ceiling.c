// ceiling: a measuring stick for bench/suite, not a proxy anyone should run. It is the leanest
// forwarder we know how to write for the two loads whose goals are ratios of the direct path, so
// that the suite can show how much of the direct rate any user-space proxy keeps on the same
// machine:
//
//   - bulk TCP: a thread per direction, blocking sockets, splice(2) socket -> pipe -> socket with
//     1 MiB pipes, half-close on EOF. Nothing waits in a poller and nothing is copied to user
//     space. (A thread and a pipe per direction is fine for one stream and hopeless for many, so
//     the suite runs only the bulk load through it.)
//   - UDP: one thread, level-triggered epoll, recvmmsg of up to 64 requests on the service socket,
//     a connected socket per client address (the session structure every proxy here has), and the
//     replies of one epoll round sent back with one sendmmsg.
//
// No timeouts, no session expiry, no limits, no error handling beyond not crashing: everything a
// real proxy must do costs extra, so beyond the machine's noise no proxy should beat it.
//
// usage: ceiling [-tcp LISTEN BACKEND]... [-udp LISTEN BACKEND]      (addresses are IPv4 ip:port)
// It serves until killed.
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

static int parse(const char *s, struct sockaddr_in *a) {
	char host[64];
	const char *c = strrchr(s, ':');
	if (!c || c - s >= (long)sizeof host) return -1;
	memcpy(host, s, c - s);
	host[c - s] = 0;
	memset(a, 0, sizeof *a);
	a->sin_family = AF_INET;
	a->sin_port = htons(atoi(c + 1));
	return inet_pton(AF_INET, host, &a->sin_addr) == 1 ? 0 : -1;
}

static void spawn(void *(*fn)(void *), void *arg) {
	pthread_attr_t at;
	pthread_t t;
	pthread_attr_init(&at);
	pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
	pthread_attr_setstacksize(&at, 256 << 10);
	if (pthread_create(&t, &at, fn, arg)) perror("pthread_create");
}

/* TCP */

struct half { int from, to; struct half *peer; int done; pthread_mutex_t *mu; };

static void *pump(void *arg) {
	struct half *h = arg;
	int p[2];
	if (pipe2(p, O_CLOEXEC) == 0) {
		fcntl(p[1], F_SETPIPE_SZ, 1 << 20);
		for (;;) {
			ssize_t n = splice(h->from, NULL, p[1], NULL, 1 << 20, SPLICE_F_MOVE);
			if (n <= 0) break;
			while (n > 0) {
				ssize_t w = splice(p[0], NULL, h->to, NULL, n, SPLICE_F_MOVE);
				if (w <= 0) break;
				n -= w;
			}
			if (n > 0) break;
		}
		close(p[0]);
		close(p[1]);
	}
	shutdown(h->to, SHUT_WR);
	pthread_mutex_lock(h->mu);
	h->done = 1;
	int last = h->peer->done;
	pthread_mutex_unlock(h->mu);
	if (last) { /* the second direction to end frees the pair */
		struct half *pair = h < h->peer ? h : h->peer;
		close(h->from);
		close(h->to);
		pthread_mutex_destroy(h->mu);
		free(h->mu);
		free(pair);
	}
	return NULL;
}

struct route { int fd; struct sockaddr_in backend; };

static void *acceptor(void *arg) {
	struct route *r = arg;
	for (;;) {
		int c = accept4(r->fd, NULL, NULL, SOCK_CLOEXEC);
		if (c < 0) { usleep(1000); continue; }
		int b = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
		if (b < 0 || connect(b, (void *)&r->backend, sizeof r->backend)) {
			if (b >= 0) close(b);
			close(c);
			continue;
		}
		int one = 1;
		setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
		setsockopt(b, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
		struct half *pair = calloc(2, sizeof *pair);
		pthread_mutex_t *mu = malloc(sizeof *mu);
		pthread_mutex_init(mu, NULL);
		pair[0] = (struct half){c, b, &pair[1], 0, mu};
		pair[1] = (struct half){b, c, &pair[0], 0, mu};
		spawn(pump, &pair[0]);
		spawn(pump, &pair[1]);
	}
	return NULL;
}

/* UDP */

#define BATCH 64
#define MAXFD 65536
#define HSIZE 65536 /* open addressing; the suite uses 32 clients */

static struct sockaddr_in client_of[MAXFD];
static struct { unsigned long long key; int fd; } sessions[HSIZE];

static void *udp_loop(void *arg) {
	struct route *r = arg;
	int ep = epoll_create1(EPOLL_CLOEXEC);
	struct epoll_event ev = {.events = EPOLLIN, .data.fd = r->fd};
	epoll_ctl(ep, EPOLL_CTL_ADD, r->fd, &ev);
	static char in[BATCH][2048], out[BATCH][2048];
	static struct mmsghdr im[BATCH], om[BATCH];
	static struct iovec iv[BATCH], ov[BATCH];
	static struct sockaddr_in from[BATCH];
	struct epoll_event evs[BATCH];
	for (;;) {
		int n = epoll_wait(ep, evs, BATCH, -1), nout = 0;
		for (int e = 0; e < n; e++) {
			int fd = evs[e].data.fd;
			if (fd != r->fd) { /* a reply on a session socket */
				ssize_t got = recv(fd, out[nout], sizeof out[nout], MSG_DONTWAIT);
				if (got < 0) continue;
				ov[nout] = (struct iovec){out[nout], (size_t)got};
				memset(&om[nout], 0, sizeof om[nout]);
				om[nout].msg_hdr.msg_iov = &ov[nout];
				om[nout].msg_hdr.msg_iovlen = 1;
				om[nout].msg_hdr.msg_name = &client_of[fd];
				om[nout].msg_hdr.msg_namelen = sizeof client_of[fd];
				nout++;
				continue;
			}
			for (int i = 0; i < BATCH; i++) {
				iv[i] = (struct iovec){in[i], sizeof in[i]};
				memset(&im[i], 0, sizeof im[i]);
				im[i].msg_hdr.msg_iov = &iv[i];
				im[i].msg_hdr.msg_iovlen = 1;
				im[i].msg_hdr.msg_name = &from[i];
				im[i].msg_hdr.msg_namelen = sizeof from[i];
			}
			int got = recvmmsg(r->fd, im, BATCH, MSG_DONTWAIT, NULL);
			for (int i = 0; i < got; i++) {
				unsigned long long key = (unsigned long long)from[i].sin_addr.s_addr << 16 | from[i].sin_port;
				unsigned h = (unsigned)(key * 0x9E3779B97F4A7C15ULL >> 40) & (HSIZE - 1);
				while (sessions[h].fd && sessions[h].key != key) h = (h + 1) & (HSIZE - 1);
				if (!sessions[h].fd) {
					int s = socket(AF_INET, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
					if (s < 0 || s >= MAXFD || connect(s, (void *)&r->backend, sizeof r->backend)) {
						if (s >= 0) close(s);
						continue;
					}
					sessions[h].key = key;
					sessions[h].fd = s;
					client_of[s] = from[i];
					struct epoll_event sev = {.events = EPOLLIN, .data.fd = s};
					epoll_ctl(ep, EPOLL_CTL_ADD, s, &sev);
				}
				send(sessions[h].fd, in[i], im[i].msg_len, MSG_DONTWAIT);
			}
		}
		if (nout) sendmmsg(r->fd, om, nout, MSG_DONTWAIT);
	}
	return NULL;
}

static struct route *listen_on(const char *laddr, const char *baddr, int type) {
	struct route *r = calloc(1, sizeof *r);
	struct sockaddr_in l;
	if (parse(laddr, &l) || parse(baddr, &r->backend)) {
		fprintf(stderr, "ceiling: bad address %s or %s\n", laddr, baddr);
		exit(2);
	}
	r->fd = socket(AF_INET, type | SOCK_CLOEXEC | (type == SOCK_DGRAM ? SOCK_NONBLOCK : 0), 0);
	int one = 1;
	setsockopt(r->fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
	if (bind(r->fd, (void *)&l, sizeof l) || (type == SOCK_STREAM && listen(r->fd, 4096))) {
		perror("ceiling: listen");
		exit(1);
	}
	return r;
}

int main(int argc, char **argv) {
	int routes = 0;
	for (int i = 1; i + 2 < argc; i += 3) {
		if (!strcmp(argv[i], "-tcp"))
			spawn(acceptor, listen_on(argv[i + 1], argv[i + 2], SOCK_STREAM));
		else if (!strcmp(argv[i], "-udp"))
			spawn(udp_loop, listen_on(argv[i + 1], argv[i + 2], SOCK_DGRAM));
		else
			break;
		routes++;
	}
	if (routes == 0 || 1 + 3 * routes != argc) {
		fprintf(stderr, "usage: ceiling [-tcp LISTEN BACKEND]... [-udp LISTEN BACKEND]\n");
		return 2;
	}
	for (;;) pause();
}
