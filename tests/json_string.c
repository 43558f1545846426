/* common/json.h's json_put_str, the one JSON string writer: the escapes
 * (quotes, backslashes, every control byte, DEL), well-formed UTF-8 of
 * every length copied as it is (a round trip through a JSON decoder
 * written here, for a code point of each range and for random strings),
 * each kind of ill-formed UTF-8 replaced by U+FFFD byte by byte, and any
 * two bytes written as valid JSON of well-formed UTF-8. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/json.h"
#include "tests/lib/testlib.h"

/* json_put_str(s) as a malloc'ed string. */
static char *put(const char *s)
{
	char *buf = NULL;
	size_t len = 0;
	FILE *f = open_memstream(&buf, &len);

	CHECK(f, "open_memstream failed");
	json_put_str(f, s);
	CHECK(!ferror(f), "write error");
	fclose(f);
	return buf;
}

static void expect(const char *in, const char *want)
{
	char *got = put(in);

	CHECK(strcmp(got, want) == 0, "input \"%s\": wrote %s, expected %s", in, got, want);
	free(got);
}

static size_t utf8_encode(uint32_t cp, char *out)
{
	if (cp < 0x80) {
		out[0] = (char)cp;
		return 1;
	}
	if (cp < 0x800) {
		out[0] = (char)(0xc0 | cp >> 6);
		out[1] = (char)(0x80 | (cp & 0x3f));
		return 2;
	}
	if (cp < 0x10000) {
		out[0] = (char)(0xe0 | cp >> 12);
		out[1] = (char)(0x80 | ((cp >> 6) & 0x3f));
		out[2] = (char)(0x80 | (cp & 0x3f));
		return 3;
	}
	out[0] = (char)(0xf0 | cp >> 18);
	out[1] = (char)(0x80 | ((cp >> 12) & 0x3f));
	out[2] = (char)(0x80 | ((cp >> 6) & 0x3f));
	out[3] = (char)(0x80 | (cp & 0x3f));
	return 4;
}

/* A JSON string (RFC 8259) back to its bytes: fails the test on anything
 * a strict decoder refuses (a raw control byte, an unknown escape, bytes
 * after the closing quote). */
static char *decode(const char *json)
{
	char *out = malloc(strlen(json) * 2 + 1), *o = out;
	const unsigned char *s = (const unsigned char *)json;

	CHECK(out, "out of memory");
	CHECK(*s++ == '"', "%s: no opening quote", json);
	for (; *s != '"'; s++) {
		CHECK(*s, "%s: no closing quote", json);
		CHECK(*s >= 0x20, "%s: raw control byte 0x%02x", json, *s);
		if (*s != '\\') {
			*o++ = (char)*s;
			continue;
		}
		s++;
		if (*s == '"' || *s == '\\' || *s == '/') {
			*o++ = (char)*s;
		} else if (*s == 'u') {
			char hex[5] = { 0 };

			memcpy(hex, s + 1, 4);
			CHECK(strspn(hex, "0123456789abcdefABCDEF") == 4, "%s: bad \\u escape", json);
			o += utf8_encode((uint32_t)strtoul(hex, NULL, 16), o);
			s += 4;
		} else {
			CHECK(0, "%s: unexpected escape \\%c", json, *s);
		}
	}
	CHECK(s[1] == '\0', "%s: bytes after the closing quote", json);
	*o = '\0';
	return out;
}

static void round_trip(const char *in)
{
	char *json = put(in), *back = decode(json);

	CHECK(strcmp(back, in) == 0, "%s did not decode back to its input", json);
	free(back);
	free(json);
}

int main(void)
{
	char buf[64];

	/* The escapes. */
	expect("", "\"\"");
	expect("worker 3 (trainer)", "\"worker 3 (trainer)\"");
	expect("say \"hi\"", "\"say \\\"hi\\\"\"");
	expect("C:\\dir\\", "\"C:\\\\dir\\\\\"");
	expect("a\nb\tc\rd", "\"a\\u000ab\\u0009c\\u000dd\"");
	expect("\x7f", "\"\\u007f\"");
	expect("/", "\"/\"");
	for (int c = 1; c < 0x20; c++) {
		char in[2] = { (char)c, 0 }, want[16];

		snprintf(want, sizeof(want), "\"\\u%04x\"", c);
		expect(in, want);
	}

	/* Well-formed UTF-8: the smallest and largest code point of each
	 * length, and the neighbours of the surrogate range. */
	expect("caf\xc3\xa9", "\"caf\xc3\xa9\"");
	expect("\xe6\x97\xa5\xe6\x9c\xac", "\"\xe6\x97\xa5\xe6\x9c\xac\"");
	expect("\xf0\x9f\x98\x80", "\"\xf0\x9f\x98\x80\"");
	{
		static const uint32_t cps[] = { 0x80, 0x7ff, 0x800, 0xd7ff, 0xe000, 0xfffd,
						0xffff, 0x10000, 0x10ffff };

		for (size_t i = 0; i < sizeof(cps) / sizeof(cps[0]); i++) {
			size_t n = utf8_encode(cps[i], buf);

			buf[n] = '\0';
			round_trip(buf);
		}
	}

	/* Ill-formed UTF-8: one U+FFFD for each byte that is not part of a
	 * well-formed sequence; what follows is read afresh. */
	expect("\x80", "\"\\ufffd\"");                       /* stray continuation */
	expect("a\xbf" "b", "\"a\\ufffdb\"");
	expect("\xc3", "\"\\ufffd\"");                       /* truncated at the end */
	expect("\xc3" "A", "\"\\ufffdA\"");                  /* truncated by ASCII */
	expect("\xe6\x97", "\"\\ufffd\\ufffd\"");            /* 2 of 3 bytes */
	expect("\xc0\xaf", "\"\\ufffd\\ufffd\"");            /* overlong '/' */
	expect("\xc1\xbf", "\"\\ufffd\\ufffd\"");
	expect("\xe0\x80\xaf", "\"\\ufffd\\ufffd\\ufffd\"");  /* overlong, 3 bytes */
	expect("\xf0\x80\x80\xaf", "\"\\ufffd\\ufffd\\ufffd\\ufffd\"");
	expect("\xed\xa0\x80", "\"\\ufffd\\ufffd\\ufffd\"");  /* surrogate U+D800 */
	expect("\xf4\x90\x80\x80", "\"\\ufffd\\ufffd\\ufffd\\ufffd\""); /* U+110000 */
	expect("\xf5\x80\x80\x80", "\"\\ufffd\\ufffd\\ufffd\\ufffd\"");
	expect("\xff\xfe", "\"\\ufffd\\ufffd\"");
	expect("\xe9t\xe9", "\"\\ufffdt\\ufffd\"");          /* Latin-1 "ete" */
	expect("\xc3\xa9\x80\xc3\xa9", "\"\xc3\xa9\\ufffd\xc3\xa9\"");

	/* Random strings of well-formed code points (controls, quotes,
	 * backslashes and every length of UTF-8 among them) come back whole. */
	srand(22);
	for (int i = 0; i < 20000; i++) {
		char s[4 * 12 + 1];
		size_t n = 0;
		int len = rand() % 12;

		for (int k = 0; k < len; k++) {
			uint32_t cp;

			switch (rand() % 4) {
			case 0:
				cp = 1 + (uint32_t)rand() % 0x7f;
				break;
			case 1:
				cp = 0x80 + (uint32_t)rand() % (0x800 - 0x80);
				break;
			case 2:
				cp = 0x800 + (uint32_t)rand() % (0x10000 - 0x800);
				if (cp >= 0xd800 && cp <= 0xdfff)
					cp = '"';
				break;
			default:
				cp = 0x10000 + (uint32_t)rand() % (0x110000 - 0x10000);
				break;
			}
			n += utf8_encode(cp, s + n);
		}
		s[n] = '\0';
		round_trip(s);
	}

	/* Every byte pair, whatever it is, is written as valid JSON
	 * (decode() checks the syntax) of well-formed UTF-8: what it decodes
	 * to makes the round trip whole (an ill-formed byte left in would
	 * become U+FFFD there). */
	for (int a = 1; a < 256; a++)
		for (int b = 1; b < 256; b++) {
			char in[3] = { (char)a, (char)b, 0 };
			char *json = put(in), *back = decode(json);

			round_trip(back);
			free(back);
			free(json);
		}
	printf("ok\n");
	return 0;
}
