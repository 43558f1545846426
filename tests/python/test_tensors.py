# shmrun: -n 2 --pool-size 1G
"""Arrays and tensors through shmrpc from Python: handed over through the
pool, not pickled. A 256 MiB array made in the pool and written by the
callee is seen written by the caller (nothing was copied); other arrays
arrive equal; torch tensors too when torch is there. Both workers run
every test at once, each calling the other (conftest.py: a module-wide
rank mark), as the script did: two 256 MiB arrays in the pool. Small plain
tensors (up to the inline threshold) travel inside the frame instead, and
arrive as memory of the receiver's own; pool tensors of any size still go
by reference.
"""
import gc
import os
import warnings

import numpy as np
import pytest

import shmrpc as rpc


pytestmark = pytest.mark.rank(0, 1)
RANK = int(os.environ.get("SHMRPC_RANK", "0"))
PEER = f"worker{1 - RANK}"


def scribble(a, value):
    a[0] = value
    a[-1] = value
    return None


def echo(x):
    return x


def total(x):
    return float(x.sum())


def test_pool_array_is_shared():
    n = 64 * 1024 * 1024  # 256 MiB of float32
    big = rpc.empty(n, "float32")
    big[:2] = 1.0  # a few spots: filling 256 MiB only measures page faults
    big[-1] = 1.0
    rpc.rpc_sync(PEER, scribble, args=(big, 7.0 + RANK))
    assert big[0] == 7.0 + RANK and big[-1] == 7.0 + RANK and big[1] == 1.0, \
        "the callee's writes to a pool array are seen by the caller"
    back = rpc.rpc_sync(PEER, echo, args=(big,))
    assert back.shape == big.shape and back[0] == big[0], "an array returned as it came"
    back[5] = 3.0
    assert big[5] == 3.0, "the returned array is the same memory"


def test_plain_array():
    plain = np.arange(12, dtype=np.int64).reshape(3, 4)
    got = rpc.rpc_sync(PEER, echo, args=(plain,))
    assert isinstance(got, np.ndarray) and got.dtype == np.int64 and got.shape == (3, 4) \
        and (got == plain).all(), f"an ordinary array arrives equal: {got!r}"
    assert rpc.rpc_sync(PEER, total, args=(plain,)) == 66.0, "the callee reads it"
    rr = rpc.remote(PEER, echo, args=(plain,))
    assert (rr.to_here() == plain).all(), "an array in an RRef"
    # Those numpy's DLPack export refuses, which failed the call with its
    # BufferError: an array of the other byte order or of long doubles
    # (pickled, it keeps its dtype) and a read-only one (np.frombuffer's
    # of bytes).
    swapped = np.arange(4, dtype=np.dtype(np.float32).newbyteorder())
    readonly = np.frombuffer(np.arange(4, dtype=np.float32).tobytes(), dtype=np.float32)
    assert not readonly.flags.writeable
    for a in (swapped, readonly, readonly[::2], np.frombuffer(b"\x07", dtype=np.uint8),
              np.arange(3, dtype=np.longdouble)):  # none in DLPack either
        got = rpc.rpc_sync(PEER, echo, args=(a,))
        assert got.dtype == a.dtype and got.shape == a.shape and (got == a).all(), repr(a)


def test_torch_tensors():
    torch = pytest.importorskip("torch")
    t = torch.arange(10, dtype=torch.float32)
    got = rpc.rpc_sync(PEER, echo, args=(t,))
    assert isinstance(got, torch.Tensor) and torch.equal(got, t), f"a torch tensor: {got!r}"
    pool_t = rpc.empty((4, 4), "float32", like="torch")
    pool_t.zero_()
    rpc.rpc_sync(PEER, scribble, args=(pool_t.view(-1), 5.0))
    assert pool_t[0, 0].item() == 5.0, "a pool torch tensor written by the callee"


def test_forked_child_drop():
    # A child forked from a worker (as torch's DataLoader forks) that drops
    # its copy of a pool array must not drop the worker's reference: the
    # block stays ours, and a new one is not laid over it.
    kept = rpc.empty(4096, "int32")
    kept[:] = 7
    pid = os.fork()
    if pid == 0:
        del kept
        gc.collect()
        os._exit(0)
    os.waitpid(pid, 0)
    fresh = [rpc.empty(4096, "int32") for _ in range(4)]
    for f in fresh:
        f[:] = 9
    assert bool((kept == 7).all()), "a forked child's drop freed the parent's pool block"


INLINE_MAX = 1024  # worker/tensor.h's TENSOR_INLINE_MAX_DEFAULT: these jobs set no other
NOT_IN_POOL = (1 << 64) - 1


def in_pool(x):
    """Whether x's bytes are a pool block (taken without a copy), as the
    pool offset of its handle says; a small plain tensor is copied into
    memory of this process instead, which has none."""
    return rpc._shmrpc.from_dlpack(x).pool_offset() != NOT_IN_POOL


def where(x):
    return x, in_pool(x)


def test_small_tensors_inline():
    # Plain tensors up to the threshold travel inside the frame, both ways,
    # and arrive equal; one byte more goes by the pool; a pool tensor of a
    # few bytes still goes by reference.
    torch = pytest.importorskip("torch")
    for n, pooled in ((INLINE_MAX - 1, False), (INLINE_MAX, False), (INLINE_MAX + 1, True)):
        t = torch.arange(n, dtype=torch.int64).to(torch.uint8)
        assert in_pool(t) == pooled, f"{n} bytes taken {'in' if in_pool(t) else 'out of'} the pool"
        got, callee_pooled = rpc.rpc_sync(PEER, where, args=(t,))
        assert callee_pooled == pooled, f"{n} bytes: the callee got it in the pool: {callee_pooled}"
        assert torch.equal(got, t), f"{n} bytes come back equal"
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
                  torch.int16, torch.int32, torch.int64, torch.uint8, torch.complex64):
        t = (torch.arange(30) - 7).reshape(2, 3, 5).to(dtype)
        got = rpc.rpc_sync(PEER, echo, args=(t,))
        assert got.dtype == dtype and got.shape == t.shape and torch.equal(got, t), \
            f"a small {dtype} tensor arrives equal: {got!r}"
        got[0, 0, 0] = 42
        assert t[0, 0, 0] != 42, "an inline tensor received is memory of the receiver's own"
    for shape in ((0,), (3, 0), ()):
        t = torch.ones(shape)
        got = rpc.rpc_sync(PEER, echo, args=(t,))
        assert got.shape == t.shape and torch.equal(got, t), f"shape {shape} arrives equal"
    pool_t = rpc.empty(4, "int32", like="torch")
    pool_t.zero_()
    got, callee_pooled = rpc.rpc_sync(PEER, where, args=(pool_t,))
    assert callee_pooled, "a 16-byte pool tensor is handed over by reference"
    rpc.rpc_sync(PEER, scribble, args=(pool_t, 3))
    assert pool_t[0].item() == 3 and pool_t[-1].item() == 3, "the callee's writes are seen"


def test_many_small_tensors():
    # Calls carrying many small tensors: all inline, all equal; a numpy
    # array of the same size too.
    torch = pytest.importorskip("torch")
    for i in range(100):
        batch = [torch.full((4,), i * 100 + k, dtype=torch.int32) for k in range(100)]
        got = rpc.rpc_sync(PEER, echo, args=(batch,))
        assert all(torch.equal(a, b) for a, b in zip(got, batch)) and len(got) == 100, \
            f"call {i}: a batch of 100 small tensors comes back equal"
    small = np.arange(16, dtype=np.float32)
    got, callee_pooled = rpc.rpc_sync(PEER, where, args=(small,))
    assert not callee_pooled and (got == small).all(), "a small numpy array travels inline"


def kinds(*args, **kwargs):
    """What the callee got: each argument's type, shape and sum."""
    return [(type(a).__name__, tuple(a.shape), float(a.sum())) for a in args] + \
        [(k, type(v).__name__, tuple(v.shape)) for k, v in sorted(kwargs.items())]


def test_tensor_only_calls():
    # A call whose arguments are only plain CPU tensors, and a result that
    # is one, travel without a pickle (_marshal._TENSORS): every shape
    # arrives as it was, a pool tensor still by reference; anything else
    # beside them (a number, a keyword, a view, a tensor that requires
    # grad) takes the pickle, and arrives as it was too.
    torch = pytest.importorskip("torch")
    a = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    b = torch.arange(5, dtype=torch.int64).reshape(5, 1).t()  # contiguous, strides (1, 1)
    c = torch.tensor(2.5)
    pool_t = rpc.empty((3, 4), "float32", like="torch")
    pool_t.fill_(1.0)
    assert rpc.rpc_sync(PEER, kinds, args=(a, b, c, pool_t)) == [
        ("Tensor", (2, 3), 15.0), ("Tensor", (1, 5), 10.0), ("Tensor", (), 2.5),
        ("Tensor", (3, 4), 12.0)], "tensors alone, of several shapes"
    for t in (a, b, c):
        got = rpc.rpc_sync(PEER, echo, args=(t,))
        assert got.shape == t.shape and got.dtype == t.dtype and torch.equal(got, t), \
            f"echoed: {got!r} for {t!r}"
    back = rpc.rpc_sync(PEER, echo, args=(pool_t,))
    back[1, 1] = 9.0
    assert pool_t[1, 1].item() == 9.0, "a pool tensor echoed is the same memory"
    assert rpc.remote(PEER, echo, args=(a,)).to_here().equal(a), "a tensor in an RRef"
    assert rpc.rpc_sync(PEER, kinds, args=(a,), kwargs={"k": b}) == [
        ("Tensor", (2, 3), 15.0), ("k", "Tensor", (1, 5))], "a keyword beside a tensor"
    assert rpc.rpc_sync(PEER, echo, args=((a, 3),))[1] == 3, "a number beside a tensor"
    assert rpc.rpc_sync(PEER, kinds, args=(a, a.t())) == [
        ("Tensor", (2, 3), 15.0), ("Tensor", (3, 2), 15.0)], "a view beside a plain tensor"
    g = torch.ones(3, requires_grad=True)
    got = rpc.rpc_sync(PEER, echo, args=(g,))
    assert torch.equal(got, g.detach()), "a tensor that requires grad"


def test_common_tensor_in_c():
    # The common tensor's fast path in C (python/_torch.c): a handle for a
    # contiguous, non-empty CPU torch.Tensor of a pool dtype that needs no
    # grad, None for anything else (pickled); a call's arguments' handles
    # only when all are such; a received handle made a torch tensor that
    # takes the handle's reference.
    torch = pytest.importorskip("torch")
    from shmrpc import _marshal, _shmrpc
    pool_t = rpc.empty((2, 3), "int32", like="torch")
    plain = torch.arange(6, dtype=torch.float64).reshape(3, 2)
    scalar = torch.tensor(7, dtype=torch.int16)
    h = _marshal._torch_handle(pool_t)
    assert h.data_ptr() == pool_t.data_ptr(), "a pool tensor by reference"
    taken = _marshal._torch_handle(plain)
    assert taken.data_ptr() != plain.data_ptr() and taken.tobytes() == plain.numpy().tobytes(), \
        "a plain tensor copied once"
    grad = torch.ones(2, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch 1.13: CSR "is in beta state"
        csr = torch.ones(2, 2).to_sparse_csr()  # which has no is_contiguous
    for other in (torch.nn.Parameter(torch.ones(2), requires_grad=False), grad,
                  plain.t(), torch.ones(0), torch.ones(2, 0), torch.ones(2, dtype=torch.bool),
                  torch.ones(2, dtype=torch.complex64), torch.ones(2, 2).to_sparse(), csr,
                  torch.ones([1] * 9), np.ones(2), 3, None, [plain]):
        assert _marshal._torch_handle(other) is None, f"not the common tensor: {other!r}"
    assert _marshal._torch_handles((plain, 3)) is None, "a number beside a tensor"
    assert _marshal._torch_handles((plain, grad)) is None, "a tensor that requires grad"
    assert _marshal._torch_handles((plain, scalar, plain)) is None, \
        "a tensor given twice (the pickler sends it once)"
    handles = _marshal._torch_handles((pool_t, plain, scalar))
    assert len(handles) == 3 and handles[0].data_ptr() == h.data_ptr()
    with pytest.raises(TypeError, match="tuple"):
        _marshal._torch_handles([plain])
    got = _shmrpc.take_torch(handles)
    assert type(got) is tuple, "a call's arguments as they are"
    for g, want in zip(got, (pool_t, plain, scalar)):
        assert type(g) is torch.Tensor and g.dtype == want.dtype and g.shape == want.shape
        assert g.stride() == want.stride() and not g.requires_grad and torch.equal(g, want)
    assert got[0].data_ptr() == pool_t.data_ptr(), "a received pool tensor shares its block"
    with pytest.raises(ValueError, match="DLPack capsule"):
        handles[0].data_ptr()  # each handle gave its reference to its tensor
    del handles
    gc.collect()
    got[1].add_(1)  # the copy's block is the tensor's now
    assert torch.equal(got[1], plain + 1)
    with pytest.raises(TypeError, match="shmrpc Tensor"):
        _shmrpc.take_torch([plain])


def both_same(a, b):
    return a is b


def first_two_same(seq):
    return seq[0] is seq[1]


def add_one_to_first(a, b):
    a.add_(1)
    return b


def twice(x):
    return x, x


def test_tensor_given_twice_arrives_once():
    # As torch's RPC pickler, which memoizes a tensor as any object: one
    # given twice in a call, or returned twice, is sent once and arrives
    # one object, so the callee's write through one name shows through the
    # other (torch 1.13 gives True and [1, 2, 3] below; each was a tensor
    # of its own here before, both on the tensors-alone path and pickled).
    torch = pytest.importorskip("torch")
    t = torch.arange(3.0)
    assert rpc.rpc_sync(PEER, both_same, args=(t, t)), "two arguments"
    assert rpc.rpc_sync(PEER, both_same, args=(t,), kwargs={"b": t}), "an argument and a keyword"
    assert rpc.rpc_sync(PEER, first_two_same, args=([t, t],)), "in a list"
    view = torch.arange(6.0).view(2, 3).t()
    assert rpc.rpc_sync(PEER, both_same, args=(view, view)), "a view, sent with its storage"
    g = torch.ones(2, requires_grad=True)
    assert rpc.rpc_sync(PEER, both_same, args=(g, g)), "a tensor that requires grad"
    a = np.arange(4)
    assert rpc.rpc_sync(PEER, both_same, args=(a, a)), "an array"
    assert not rpc.rpc_sync(PEER, both_same, args=(t, t.clone())), "two tensors stay two"
    back = rpc.rpc_sync(PEER, twice, args=(t,))
    assert back[0] is back[1], "a result"
    assert rpc.rpc_sync(PEER, add_one_to_first, args=(t, t)).tolist() == [1.0, 2.0, 3.0]
    assert t.tolist() == [0.0, 1.0, 2.0], "the caller's tensor is its own, as torch's"


def test_sparse_and_many_dims():
    # As torch's: a sparse tensor arrives sparse (pickled: it has no
    # strided bytes), and a tensor or array of more dimensions than a
    # handle holds (8) arrives in its shape (sent flat). Both failed
    # before: "Cannot access data pointer of Tensor that doesn't have
    # storage", "a shape is a tuple of at most 8 sizes".
    torch = pytest.importorskip("torch")
    sparse = torch.sparse_coo_tensor([[0, 1, 1], [2, 0, 2]], [3.0, 4.0, 5.0], (2, 3))
    for back in (rpc.rpc_sync(PEER, echo, args=(sparse,)),
                 rpc.rpc_sync(PEER, echo, args=([sparse, 1],))[0]):
        assert back.layout == torch.sparse_coo and torch.equal(back.to_dense(), sparse.to_dense())
    assert torch.equal(rpc.rpc_sync(PEER, torch.add, args=(sparse, sparse)).to_dense(),
                       2 * sparse.to_dense()), "a builtin's sparse arguments"
    many = torch.arange(2 ** 9, dtype=torch.float32).reshape([2] * 9)
    for x in (many, many.transpose(0, 8), many[None]):
        back = rpc.rpc_sync(PEER, echo, args=(x,))
        assert back.shape == x.shape and torch.equal(back, x), f"{x.dim()} dimensions"
    a = np.arange(2 ** 9).reshape([2] * 9)
    back = rpc.rpc_sync(PEER, echo, args=([a],))[0]
    assert back.shape == a.shape and (back == a).all(), "an array of 9 dimensions"


def negative_of_imag():
    import torch
    return torch.tensor([1 + 2j]).conj().imag


def test_tensors_whose_bytes_are_not_their_values():
    # A negative view (x.conj().imag) and a conjugate one (x.conj()) hold
    # the bytes of what they view and a bit that says the sign; one of a
    # single element is contiguous, of a pool dtype, with a data_ptr() of
    # those bytes. They arrive with their values: -2 below, not 2. They
    # were sent as their bytes before, in C, in a list by the pickler, and
    # as a result (a complex one by torch's own reduce); torch 1.13's RPC
    # and DLPack export drop the bit too (docs/COMPAT.md).
    torch = pytest.importorskip("torch")
    from shmrpc import _marshal
    neg = torch.tensor([1 + 2j]).conj().imag
    assert neg.is_neg() and neg.is_contiguous() and neg.dtype == torch.float32
    assert _marshal._torch_handle(neg) is None, "not the common tensor: its bytes are not its values"
    assert rpc.rpc_sync(PEER, echo, args=(neg,)).tolist() == [-2.0], "an argument"
    assert rpc.rpc_sync(PEER, echo, args=([neg, 1],))[0].tolist() == [-2.0], "in a list"
    assert rpc.rpc_sync(PEER, negative_of_imag).tolist() == [-2.0], "a result"
    assert rpc.remote(PEER, negative_of_imag).to_here().tolist() == [-2.0], "an RRef's value"
    strided = torch.tensor([1 + 2j, 3 - 4j]).conj().imag
    assert rpc.rpc_sync(PEER, echo, args=(strided,)).tolist() == [-2.0, 4.0], "not contiguous"
    conj = torch.tensor([1 + 2j]).conj()
    assert rpc.rpc_sync(PEER, echo, args=(conj,)).tolist() == [1 - 2j], "a conjugate view"
    # A tensor without storage (torch's ZeroTensor: data_ptr() 0) arrives
    # as zeros; its address 0 was read before (a segmentation fault).
    zeros = torch._efficientzerotensor(3)
    assert zeros.data_ptr() == 0 and _marshal._torch_handle(zeros) is None
    for back in (rpc.rpc_sync(PEER, echo, args=(zeros,)),
                 rpc.rpc_sync(PEER, echo, args=([zeros, 1],))[0]):
        assert back.tolist() == [0.0, 0.0, 0.0], "a tensor without storage"


def test_tensor_only_calls_from_the_first():
    # Every pool dtype takes the pickle-free form from its first tensor on
    # (the dtypes are known with torch, not learnt from a pickled first).
    torch = pytest.importorskip("torch")
    from shmrpc import _marshal
    for dtype in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8,
                  torch.float16, torch.float32, torch.float64):
        t = torch.ones(3, dtype=dtype)
        payload, rrefs, tensors = _marshal._pack_call(echo, (t,), None)
        assert payload.endswith(_marshal._TENSORS) and len(tensors) == 1, dtype
        got = rpc.rpc_sync(PEER, echo, args=(t,))
        assert got.dtype == dtype and torch.equal(got, t), dtype
    assert not _marshal._TORCH_DTYPE_OK.get(torch.bool), "bool is pickled (no DLPack bool)"


def grad_of(x):
    return type(x).__name__, x.requires_grad


def test_parameter_arrives_a_parameter():
    # As torch's RPC pickler, which hands over torch.Tensor alone: a
    # Parameter goes by its own reduce, its data handed over, and arrives a
    # Parameter that requires grad as it did (torch 1.13 does the same).
    torch = pytest.importorskip("torch")
    p = torch.nn.Parameter(torch.arange(3, dtype=torch.float32))
    assert rpc.rpc_sync(PEER, grad_of, args=(p,)) == ("Parameter", True)
    frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)
    assert rpc.rpc_sync(PEER, grad_of, args=(frozen,)) == ("Parameter", False)
    back = rpc.rpc_sync(PEER, echo, args=(p,))
    assert type(back) is torch.nn.Parameter and torch.equal(back.detach(), p.detach())


_kept = []


def keep_and_echo(x):
    _kept.append(x)
    return x


def kept_sum():
    total = float(_kept[-1].sum())
    _kept.clear()
    return total


def as_view(x):
    return x.view(2, -1)


def as_slice(x):
    return x[1:]


def test_pool_tensor_echoed_back():
    # A pool tensor returned whole goes back covered by the caller's pin of
    # its request (no pin of the callee's, no TENSOR_ACK: docs/PROTOCOL.md);
    # a callee that keeps it still holds it after the caller let go; a view
    # of it or a slice go the normal way. Each arrives as it was.
    torch = pytest.importorskip("torch")
    t = rpc.empty(4096, "float32", like="torch")
    t.copy_(torch.arange(4096, dtype=torch.float32))
    for _ in range(200):
        back = rpc.rpc_sync(PEER, echo, args=(t,))
        assert back.data_ptr() == t.data_ptr(), "an echo is the same memory"
    kept = rpc.empty(4096, "float32", like="torch")
    kept.fill_(2.0)
    back = rpc.rpc_sync(PEER, keep_and_echo, args=(kept,))
    del kept, back
    gc.collect()
    assert rpc.rpc_sync(PEER, kept_sum) == 8192.0, "the callee's kept tensor, the caller's gone"
    view = rpc.rpc_sync(PEER, as_view, args=(t,))
    assert view.shape == (2, 2048) and torch.equal(view.reshape(-1), t), "a view of it"
    part = rpc.rpc_sync(PEER, as_slice, args=(t,))
    assert torch.equal(part, t[1:]), "a slice of it"


def test_taken_handle_is_empty():
    # A received handle made into a torch tensor gives it its own reference
    # (take_dlpack; take_torch in _marshal._from_handles): the tensor keeps the block
    # after the handle is gone, and the emptied handle refuses every use,
    # a send included, with a sentence (never a crash).
    torch = pytest.importorskip("torch")
    h = rpc._shmrpc.empty((4,), 2, 32)  # float32
    t = torch.utils.dlpack.from_dlpack(rpc._shmrpc.take_dlpack(h))
    t.copy_(torch.arange(4, dtype=torch.float32))
    for use in (h.data_ptr, h.pool_offset, h.tobytes, h.__dlpack__, h.__dlpack_device__,
                lambda: h.__array_interface__, lambda: rpc._shmrpc.take_dlpack(h),
                lambda: rpc.rpc_sync(PEER, echo, args=(h,))):
        with pytest.raises(ValueError, match="DLPack capsule"):
            use()
    del h
    gc.collect()
    got = rpc.rpc_sync(PEER, echo, args=(t,))
    assert torch.equal(got, torch.arange(4, dtype=torch.float32)), "the tensor kept its block"
    assert got.data_ptr() == t.data_ptr(), "and is sent by reference: its block"


def test_plain_tensor_copied_once():
    # A plain tensor above the inline threshold is copied into a pool block
    # once, as it is sent (rpc_async has returned): the callee gets that
    # block, equal to what was sent, whatever the caller writes to its own
    # tensor after; the echo hands the same block back, not a copy.
    torch = pytest.importorskip("torch")
    sent = torch.arange(1 << 18, dtype=torch.int32)  # 1 MiB
    t = sent.clone()
    fut = rpc.rpc_async(PEER, keep_and_echo, args=(t,))
    t.fill_(-1)
    back = fut.wait()
    assert torch.equal(back, sent), "the callee got the bytes as they were when sent"
    assert in_pool(back) and back.data_ptr() != t.data_ptr(), \
        "a 1 MiB plain tensor arrives as a pool block, not the caller's memory"
    back[0] = 5
    assert rpc.rpc_sync(PEER, kept_sum) == float(sent.sum()) + 5, \
        "the echo is the block the callee kept (one copy, on the way out)"
    assert t[0].item() == -1, "the caller's own tensor stays its own"
