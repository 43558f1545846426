/*
 * --tag-output: each worker's stdout and stderr come through a pipe, and
 * the launcher writes them out a whole line at a time with "[rank] " in
 * front, so that lines of different workers never mix. A line longer than
 * the buffer goes out in pieces, the prefix on the first only.
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "launcher/shmrun.h"

int output_open(struct out_stream *s, int dst, uint32_t rank, int *child_end)
{
	int fds[2];

	if (pipe2(fds, O_CLOEXEC) < 0)
		return -1;
	/* Non-blocking: the launcher reads what is there and goes back to poll. */
	if (fcntl(fds[0], F_SETFL, O_NONBLOCK) < 0) {
		close(fds[0]);
		close(fds[1]);
		return -1;
	}
	s->fd = fds[0];
	s->dst = dst;
	s->rank = rank;
	s->mid_line = false;
	s->len = 0;
	*child_end = fds[1];
	return 0;
}

/* Writes it all; gives up quietly if the reader went away (EPIPE). */
static void write_all(int fd, const char *p, size_t n)
{
	while (n) {
		ssize_t w = write(fd, p, n);

		if (w < 0 && errno == EAGAIN) {
			struct pollfd pfd = { .fd = fd, .events = POLLOUT };

			poll(&pfd, 1, -1);
			continue;
		}
		if (w < 0 && errno == EINTR)
			continue;
		if (w < 0)
			return;
		p += w;
		n -= (size_t)w;
	}
}

/* One piece of a line: the prefix if the line starts here, and a newline
 * if end_line asks to finish a line the worker left unfinished. */
static void emit(struct out_stream *s, const char *p, size_t n, bool end_line)
{
	char out[sizeof(s->buf) + 32];
	size_t at = 0;

	if (!s->mid_line)
		at = (size_t)snprintf(out, sizeof(out), "[%u] ", s->rank);
	memcpy(out + at, p, n);
	at += n;
	if (end_line)
		out[at++] = '\n';
	write_all(s->dst, out, at);
	s->mid_line = !end_line && !(n && p[n - 1] == '\n');
}

static void flush_and_close(struct out_stream *s)
{
	if (s->len || s->mid_line)
		emit(s, s->buf, s->len, true);
	s->len = 0;
	close(s->fd);
	s->fd = -1;
}

/* One read: 1 if bytes came, 0 if none are there now, -1 once closed. */
static int pump_once(struct out_stream *s)
{
	size_t start = 0;
	ssize_t n;
	char *nl;

	do
		n = read(s->fd, s->buf + s->len, sizeof(s->buf) - s->len);
	while (n < 0 && errno == EINTR);
	if (n < 0 && errno == EAGAIN)
		return 0;
	if (n <= 0) {
		flush_and_close(s);
		return -1;
	}
	s->len += (size_t)n;
	while ((nl = memchr(s->buf + start, '\n', s->len - start))) {
		size_t end = (size_t)(nl - s->buf) + 1;

		emit(s, s->buf + start, end - start, false);
		start = end;
	}
	if (start == 0 && s->len == sizeof(s->buf)) {
		emit(s, s->buf, s->len, false);
		start = s->len;
	}
	memmove(s->buf, s->buf + start, s->len - start);
	s->len -= start;
	return 1;
}

void output_pump(struct out_stream *s)
{
	pump_once(s);
}

void output_finish(struct out_stream *s)
{
	if (s->fd < 0)
		return;
	while (pump_once(s) > 0)
		;
	/* Still open: something the worker started holds the pipe. Its
	 * output from now on is lost rather than the launcher waiting on it. */
	if (s->fd >= 0)
		flush_and_close(s);
}
