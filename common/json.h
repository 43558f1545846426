/*
 * The one JSON string writer of shmrpc (the launcher's trace file,
 * shmrpc-inspect --json, shmrpc_profile_export_chrome), so that every JSON
 * file shmrpc writes follows one rule whatever bytes a name holds.
 */
#ifndef SHMRPC_COMMON_JSON_H
#define SHMRPC_COMMON_JSON_H

#include <stdio.h>

#include "common/compiler.h"

/*
 * Writes s (NUL-terminated) to f as a JSON string, quotes included, so
 * that the output is valid UTF-8 JSON whatever s holds: '"' and '\' are
 * escaped with a backslash; control bytes (below 0x20) and DEL as \u00XX;
 * well-formed UTF-8 is copied as it is; each byte that is not part of a
 * well-formed sequence (stray continuation bytes, truncated or overlong
 * sequences, surrogates, code points above U+10FFFF) becomes U+FFFD, the
 * replacement character. Write errors show in ferror(f), as with stdio.
 */
SHMRPC_HIDDEN void json_put_str(FILE *f, const char *s);

#endif
