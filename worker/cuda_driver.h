/*
 * The CUDA driver's types and constants that worker/cuda.c uses (and the
 * stand-in driver of tests/fake_cuda implements), declared by hand rather
 * than taken from <cuda.h>: the Makefile does not put the toolkit's
 * include directory on the path, and the library must build where CUDA is
 * not installed. Values and layouts are those of cuda.h (CUDA 13),
 * unchanged since the functions appeared; handles are opaque pointers,
 * IPC handles 64-byte structs passed by value, like the originals.
 */
#ifndef SHMRPC_WORKER_CUDA_DRIVER_H
#define SHMRPC_WORKER_CUDA_DRIVER_H

#define CU_IPC_HANDLE_SIZE 64

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;
typedef struct {
	char reserved[CU_IPC_HANDLE_SIZE];
} CUipcMemHandle;
typedef struct {
	char reserved[CU_IPC_HANDLE_SIZE];
} CUipcEventHandle;
typedef struct {
	char bytes[16];
} CUuuid;

enum { /* CUresult */
	CUDA_SUCCESS = 0,
	CUDA_ERROR_INVALID_VALUE = 1,
	CUDA_ERROR_OUT_OF_MEMORY = 2,
	CUDA_ERROR_NO_DEVICE = 100,
	CUDA_ERROR_INVALID_DEVICE = 101,
	CUDA_ERROR_INVALID_CONTEXT = 201,
	CUDA_ERROR_MAP_FAILED = 205,
	CUDA_ERROR_INVALID_HANDLE = 400,
	CUDA_ERROR_NOT_FOUND = 500,
	CUDA_ERROR_NOT_READY = 600,
	CUDA_ERROR_NOT_PERMITTED = 800,
	CUDA_ERROR_NOT_SUPPORTED = 801,
};

enum { /* CUpointer_attribute */
	CU_POINTER_ATTRIBUTE_CONTEXT = 1,
	CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2,
	CU_POINTER_ATTRIBUTE_BUFFER_ID = 7,
	CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9,
};

#define CU_MEMORYTYPE_DEVICE 2u
#define CU_EVENT_DISABLE_TIMING 0x2u
#define CU_EVENT_INTERPROCESS 0x4u
#define CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS 0x1u
/* The default streams' handles (cuda.h's; DLPack names them 1 and 2). */
#define CU_STREAM_LEGACY ((CUstream)0x1)
#define CU_STREAM_PER_THREAD ((CUstream)0x2)

#endif
