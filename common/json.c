/* JSON strings (common/json.h). */
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/json.h"

/* The length of the well-formed UTF-8 sequence at s (lead byte s[0] >=
 * 0x80), or 0 when it is not one (RFC 3629, section 4: the second byte's
 * range depends on the lead, which excludes overlong forms, surrogates and
 * code points above U+10FFFF). A NUL ends the string, and fails the range
 * test of a continuation byte. */
static size_t utf8_len(const unsigned char *s)
{
	unsigned char lo = 0x80, hi = 0xbf;
	size_t n;

	if (s[0] >= 0xc2 && s[0] <= 0xdf)
		n = 2;
	else if (s[0] >= 0xe0 && s[0] <= 0xef)
		n = 3;
	else if (s[0] >= 0xf0 && s[0] <= 0xf4)
		n = 4;
	else
		return 0;
	if (s[0] == 0xe0)
		lo = 0xa0;
	else if (s[0] == 0xed)
		hi = 0x9f;
	else if (s[0] == 0xf0)
		lo = 0x90;
	else if (s[0] == 0xf4)
		hi = 0x8f;
	if (s[1] < lo || s[1] > hi)
		return 0;
	for (size_t i = 2; i < n; i++)
		if (s[i] < 0x80 || s[i] > 0xbf)
			return 0;
	return n;
}

static bool plain(unsigned char c)
{
	return c >= 0x20 && c < 0x7f && c != '"' && c != '\\';
}

void json_put_str(FILE *f, const char *str)
{
	const unsigned char *s = (const unsigned char *)str;

	fputc('"', f);
	while (*s) {
		size_t run = 0, n;

		/* Names are mostly plain ASCII: one fwrite per run of it. */
		while (plain(s[run]))
			run++;
		if (run) {
			fwrite(s, 1, run, f);
			s += run;
		} else if (*s == '"' || *s == '\\') {
			fputc('\\', f);
			fputc(*s++, f);
		} else if (*s < 0x80) {
			fprintf(f, "\\u%04x", *s++);
		} else if ((n = utf8_len(s))) {
			fwrite(s, 1, n, f);
			s += n;
		} else {
			fputs("\\ufffd", f);
			s++;
		}
	}
	fputc('"', f);
}
