/* A native transform for tests/python/test_data_native.py: x -> 2x + 1 on a
 * float32 tensor, in place; -22 (EINVAL) for any other dtype. */
#include <dlpack/dlpack.h>
#include <stdint.h>

int twice_plus_one(DLTensor *t);

int twice_plus_one(DLTensor *t)
{
	int64_t n = 1;
	float *x = (float *)((char *)t->data + t->byte_offset);

	if (t->dtype.code != kDLFloat || t->dtype.bits != 32 || t->dtype.lanes != 1)
		return -22;
	for (int32_t i = 0; i < t->ndim; i++)
		n *= t->shape[i];
	for (int64_t i = 0; i < n; i++)
		x[i] = 2 * x[i] + 1;
	return 0;
}
