/*
 * The library's calls point one way. Folders first: common/ -> shm/ ->
 * ipc/ -> worker/, no object calling into a folder above its own. Inside
 * worker/, each file has a level, declared in docs/ARCHITECTURE.md (the
 * table after LEVELS_MARK, read here, so that the docs and the check are
 * one), and calls only files of lower levels: anything upward goes
 * through a hook set at init. Read from the object files with nm: a call
 * is an undefined symbol of one object that another defines. Each call
 * against the levels is printed as "file -> file (symbol)". The Python
 * extension (the .c files of python/) reaches worker/ through one header made for it,
 * worker/python_api.h: it includes no other worker header.
 */
#include <ctype.h>
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/lib/job.h"
#include "tests/lib/testlib.h"

#define LEVELS_DOC "docs/ARCHITECTURE.md"
#define LEVELS_MARK "<!-- worker levels: read by tests/layers.c -->"
#define MAX_OBJS 128
#define MAX_SYMS 8192

static const char *const folders[] = { "common", "shm", "ipc", "worker" };
#define NFOLDERS (int)(sizeof(folders) / sizeof(folders[0]))

struct obj {
	char name[64]; /* "worker/link" */
	int folder;    /* index in folders */
	int level;     /* worker/ only: from the table; -1 none */
	char **undef;
	int nundef;
};

struct def {
	char *sym;
	int obj;
};

static struct obj objs[MAX_OBJS];
static int nobjs;
static struct def defs[MAX_SYMS];
static int ndefs;

static int def_cmp(const void *a, const void *b)
{
	return strcmp(((const struct def *)a)->sym, ((const struct def *)b)->sym);
}

/* Reads one object's global symbols: defined ones into defs, undefined
 * ones into its list. */
static void read_symbols(int i, const char *path)
{
	char cmd[PATH_MAX + 400], line[512];
	FILE *p;
	int cap = 0;

	snprintf(cmd, sizeof(cmd), "/usr/bin/nm --format=posix '%s'", path);
	p = popen(cmd, "r");
	CHECK(p, "cannot run nm (binutils' nm is needed)");
	while (fgets(line, sizeof(line), p)) {
		char sym[400], type;

		if (sscanf(line, "%399s %c", sym, &type) != 2)
			continue;
		if (type == 'U') {
			if (objs[i].nundef == cap) {
				cap = cap ? 2 * cap : 64;
				objs[i].undef = realloc(objs[i].undef, cap * sizeof(char *));
				CHECK(objs[i].undef, "out of memory");
			}
			CHECK((objs[i].undef[objs[i].nundef++] = strdup(sym)), "out of memory");
		} else if (isupper((unsigned char)type)) {
			CHECK(ndefs < MAX_SYMS, "more than %d symbols", MAX_SYMS);
			CHECK((defs[ndefs].sym = strdup(sym)), "out of memory");
			defs[ndefs++].obj = i;
		}
	}
	CHECK(pclose(p) == 0, "nm %s failed", path);
}

/* Every object of the library, by folder. */
static void read_objects(void)
{
	for (int f = 0; f < NFOLDERS; f++) {
		char rel[64], dir[PATH_MAX], path[PATH_MAX + 260];
		struct dirent *e;
		DIR *d;

		snprintf(rel, sizeof(rel), "obj/%s", folders[f]);
		d = opendir(tl_build_path(dir, rel));
		CHECK(d, "cannot open %s: build the library first", dir);
		while ((e = readdir(d))) {
			size_t len = strlen(e->d_name);

			if (len < 3 || strcmp(e->d_name + len - 2, ".o"))
				continue;
			CHECK(nobjs < MAX_OBJS, "more than %d objects", MAX_OBJS);
			snprintf(objs[nobjs].name, sizeof(objs[nobjs].name), "%s/%.*s", folders[f],
				 (int)(len - 2), e->d_name);
			objs[nobjs].folder = f;
			objs[nobjs].level = -1;
			snprintf(path, sizeof(path), "%s/%s", dir, e->d_name);
			read_symbols(nobjs++, path);
		}
		closedir(d);
	}
	qsort(defs, (size_t)ndefs, sizeof(defs[0]), def_cmp);
}

static int find_obj(const char *name)
{
	for (int i = 0; i < nobjs; i++)
		if (strcmp(objs[i].name, name) == 0)
			return i;
	return -1;
}

/* The table after LEVELS_MARK: rows "| level | `file.c` | job |", up to
 * the first line that is not a row. Returns how many rows named a file
 * with no object (each said). */
static int read_levels(void)
{
	FILE *f = fopen(LEVELS_DOC, "r");
	char line[1024];
	bool in = false;
	int rows = 0, stale = 0;

	CHECK(f, "cannot read %s: run the test from the repository's root", LEVELS_DOC);
	while (fgets(line, sizeof(line), f)) {
		char file[64], name[80];
		const char *tick;
		int level, i;

		if (!in) {
			in = strstr(line, LEVELS_MARK) != NULL;
			continue;
		}
		if (line[0] != '|')
			break;
		if (sscanf(line, "| %d |", &level) != 1)
			continue; /* the header and its rule */
		tick = strchr(line, '`');
		CHECK(tick && sscanf(tick, "`%63[a-z_0-9].c`", file) == 1,
		      "%s: a level row without a `file.c`: %s", LEVELS_DOC, line);
		snprintf(name, sizeof(name), "worker/%s", file);
		rows++;
		if ((i = find_obj(name)) < 0) {
			fprintf(stderr, "%s names worker/%s.c, which the library does not have\n",
				LEVELS_DOC, file);
			stale++;
			continue;
		}
		CHECK(objs[i].level < 0, "%s gives worker/%s.c two levels", LEVELS_DOC, file);
		objs[i].level = level;
	}
	fclose(f);
	CHECK(rows > 0, "no level table after \"%s\" in %s", LEVELS_MARK, LEVELS_DOC);
	return stale;
}

/* The worker headers the .c files of python/ include other than PYTHON_API, each said;
 * how many. */
#define PYTHON_API "worker/python_api.h"
#define INCLUDE "#include \""
static int python_includes(void)
{
	DIR *d = opendir("python");
	struct dirent *e;
	int wrong = 0;

	CHECK(d, "cannot open python/: run the test from the repository's root");
	while ((e = readdir(d))) {
		size_t len = strlen(e->d_name);
		char path[300], line[512];
		FILE *f;

		if (len < 3 || strcmp(e->d_name + len - 2, ".c"))
			continue;
		snprintf(path, sizeof(path), "python/%s", e->d_name);
		CHECK((f = fopen(path, "r")), "cannot read %s", path);
		while (fgets(line, sizeof(line), f))
			if (strncmp(line, INCLUDE "worker/", strlen(INCLUDE "worker/")) == 0 &&
			    strncmp(line + strlen(INCLUDE), PYTHON_API "\"", strlen(PYTHON_API) + 1)) {
				fprintf(stderr, "%s includes %.*s: the extension reaches worker/ "
					"through " PYTHON_API " alone\n", path,
					(int)strcspn(line + 9, "\n"), line + 9);
				wrong++;
			}
		fclose(f);
	}
	closedir(d);
	return wrong;
}

/* Whether a call from object a to object b keeps the levels. */
static bool allowed(const struct obj *a, const struct obj *b)
{
	if (a->folder != b->folder)
		return a->folder > b->folder;
	if (strcmp(folders[a->folder], "worker"))
		return true; /* the folders below worker/ are layered as wholes */
	/* A file without a level is said once, not at each call. */
	return a->level < 0 || b->level < 0 || b->level < a->level;
}

int main(void)
{
	int wrong, calls = 0;

	read_objects();
	wrong = read_levels() + python_includes();
	for (int i = 0; i < nobjs; i++)
		if (objs[i].folder == NFOLDERS - 1 && objs[i].level < 0) {
			fprintf(stderr, "%s.c has no level in %s\n", objs[i].name, LEVELS_DOC);
			wrong++;
		}
	for (int i = 0; i < nobjs; i++)
		for (int u = 0; u < objs[i].nundef; u++) {
			struct def key = { .sym = objs[i].undef[u] }, *d;
			const struct obj *a = &objs[i], *b;

			d = bsearch(&key, defs, (size_t)ndefs, sizeof(defs[0]), def_cmp);
			if (!d || d->obj == i)
				continue; /* another library's, or its own */
			b = &objs[d->obj];
			calls++;
			if (allowed(a, b))
				continue;
			if (a->folder != b->folder)
				fprintf(stderr, "%s.c -> %s.c (%s): %s/ calls up into %s/\n", a->name,
					b->name, key.sym, folders[a->folder], folders[b->folder]);
			else
				fprintf(stderr, "%s.c -> %s.c (%s): level %d calls level %d\n", a->name,
					b->name, key.sym, a->level, b->level);
			wrong++;
		}
	CHECK(wrong == 0, "%d calls, files or includes against the layers of %s (above)", wrong,
	      LEVELS_DOC);
	CHECK(calls > 100, "only %d calls between the library's objects found", calls);
	printf("%d objects, %d calls between them, all pointing down\n", nobjs, calls);
	for (int i = 0; i < nobjs; i++) {
		for (int u = 0; u < objs[i].nundef; u++)
			free(objs[i].undef[u]);
		free(objs[i].undef);
	}
	for (int i = 0; i < ndefs; i++)
		free(defs[i].sym);
	return 0;
}
