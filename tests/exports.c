/*
 * libshmrpc.so exports the public API and nothing else: the functions
 * declared SHMRPC_API in include/shmrpc.h, each under the version node of
 * libshmrpc.map, and no other symbol (liburing's and msgpack-c's, linked in
 * statically, nor the library's own internals). Read with nm -D, as a
 * program linking the library sees it.
 */
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/lib/job.h"
#include "tests/lib/run.h"
#include "tests/lib/testlib.h"

#define MAX_SYMS 256
#define NODE "SHMRPC_0"

struct names {
	char *v[MAX_SYMS];
	int n;
};

static void add(struct names *s, const char *name, size_t len)
{
	CHECK(s->n < MAX_SYMS, "more than %d names", MAX_SYMS);
	CHECK((s->v[s->n++] = strndup(name, len)), "out of memory");
}

static bool has(const struct names *s, const char *name)
{
	for (int i = 0; i < s->n; i++)
		if (strcmp(s->v[i], name) == 0)
			return true;
	return false;
}

/* The name of each function declared "SHMRPC_API type name(" in the
 * header (a declaration may span lines: the name is the identifier
 * before the first '(' after SHMRPC_API). */
static void declared(struct names *s)
{
	FILE *f = fopen("include/shmrpc.h", "r");
	static char text[1 << 17];
	size_t len;

	CHECK(f, "cannot read include/shmrpc.h: run the test from the repository's root");
	len = fread(text, 1, sizeof(text) - 1, f);
	fclose(f);
	CHECK(len < sizeof(text) - 1, "include/shmrpc.h is larger than the test reads");
	text[len] = '\0';
	for (const char *at = text; (at = strstr(at, "SHMRPC_API ")); at++) {
		const char *paren = strchr(at, '('), *end = paren, *start;

		if (at > text && at[-1] != '\n')
			continue; /* the #define of SHMRPC_API itself */
		CHECK(paren, "SHMRPC_API without a function after it");
		while (end > at && isspace((unsigned char)end[-1]))
			end--;
		for (start = end; start > at && (isalnum((unsigned char)start[-1]) || start[-1] == '_');)
			start--;
		add(s, start, (size_t)(end - start));
	}
}

/* Each defined dynamic symbol of the library, as "name@@version". */
static void exported(struct names *s)
{
	static char out[1 << 16];
	char lib[PATH_MAX];
	const char *argv[] = { "/usr/bin/nm", "-D", "--defined-only", "--with-symbol-versions",
			       "--format=posix", tl_build_path(lib, "libshmrpc.so"), NULL };
	int rc = tl_run(out, sizeof(out), argv);

	CHECK(rc == 0, "nm -D %s exited %d (binutils' nm is needed)", lib, rc);
	for (char *line = strtok(out, "\n"); line; line = strtok(NULL, "\n"))
		add(s, line, strcspn(line, " "));
}

int main(void)
{
	struct names decl = { 0 }, exp = { 0 };
	int wrong = 0, ours = 0;

	declared(&decl);
	exported(&exp);
	CHECK(decl.n > 40, "only %d SHMRPC_API declarations found in shmrpc.h", decl.n);
	for (int i = 0; i < exp.n; i++) {
		char *at = strstr(exp.v[i], "@@");

		if (strcmp(exp.v[i], NODE) == 0)
			continue; /* the version node's own symbol */
		if (!at || strcmp(at + 2, NODE) != 0) {
			fprintf(stderr, "exported without version " NODE ": %s\n", exp.v[i]);
			wrong++;
			continue;
		}
		*at = '\0';
		if (!has(&decl, exp.v[i])) {
			fprintf(stderr, "exported, but not declared SHMRPC_API in shmrpc.h: %s\n",
				exp.v[i]);
			wrong++;
		}
		ours++;
	}
	for (int i = 0; i < decl.n; i++)
		if (!has(&exp, decl.v[i])) {
			fprintf(stderr, "declared in shmrpc.h, not exported: %s\n", decl.v[i]);
			wrong++;
		}
	CHECK(wrong == 0, "%d symbols wrong (above)", wrong);
	printf("%d functions exported under " NODE ", as shmrpc.h declares them\n", ours);
	for (int i = 0; i < decl.n; i++)
		free(decl.v[i]);
	for (int i = 0; i < exp.n; i++)
		free(exp.v[i]);
	return 0;
}
