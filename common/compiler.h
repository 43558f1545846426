/* Small compiler helpers shared by every layer. */
#ifndef SHMRPC_COMMON_COMPILER_H
#define SHMRPC_COMMON_COMPILER_H

#define SHMRPC_CACHELINE 64
#define shmrpc_likely(x) __builtin_expect(!!(x), 1)
#define shmrpc_unlikely(x) __builtin_expect(!!(x), 0)
#define SHMRPC_HIDDEN __attribute__((visibility("hidden")))
#define SHMRPC_PRINTF(a, b) __attribute__((format(printf, a, b)))

static inline void shmrpc_cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
	__builtin_ia32_pause();
#elif defined(__aarch64__)
	__asm__ __volatile__("yield" ::: "memory");
#else
	__asm__ __volatile__("" ::: "memory");
#endif
}

#endif
