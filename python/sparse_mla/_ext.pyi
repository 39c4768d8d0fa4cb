"""Type stubs of sparse_mla._ext, the C++ API over DLPack (use the sparse_mla package instead).

Array arguments accept anything with ``__dlpack__`` or the buffer protocol; ``None`` where
optional. uint16 arrays are read as bfloat16 bit patterns."""

from typing import Any, Callable, List, Optional, Sequence, Tuple

Array = Any
"""An object exporting DLPack (torch, cupy, jax, ...) or the buffer protocol (numpy)."""

cuda_built: bool

class UnsupportedError(NotImplementedError):
    """A valid request that no backend of this build can run on this machine."""

def available_backends() -> List[str]: ...
def empty(shape: Sequence[int], dtype: str, cuda: bool = False, device: int = 0) -> Any: ...

def sparse_decode_workspace_size(
    q: Array, k_cache: Array, indices: Array, topk_length: Optional[Array] = None,
    extra_k_cache: Optional[Array] = None, extra_indices: Optional[Array] = None,
    extra_topk_length: Optional[Array] = None, attn_sink: Optional[Array] = None,
    softmax_scale: Optional[float] = None, out: Optional[Array] = None,
    lse: Optional[Array] = None, backend: str = "auto",
) -> Tuple[int, int]: ...
def sparse_decode_supported(
    q: Array, k_cache: Array, indices: Array, topk_length: Optional[Array] = None,
    extra_k_cache: Optional[Array] = None, extra_indices: Optional[Array] = None,
    extra_topk_length: Optional[Array] = None, attn_sink: Optional[Array] = None,
    softmax_scale: Optional[float] = None, out: Optional[Array] = None,
    lse: Optional[Array] = None, backend: str = "auto",
) -> Tuple[bool, str, str]: ...
def sparse_decode_plan(
    q: Array, k_cache: Array, indices: Array, topk_length: Optional[Array] = None,
    extra_k_cache: Optional[Array] = None, extra_indices: Optional[Array] = None,
    extra_topk_length: Optional[Array] = None, attn_sink: Optional[Array] = None,
    softmax_scale: Optional[float] = None, out: Optional[Array] = None,
    lse: Optional[Array] = None, plan: Optional[Array] = None,
    scratch: Optional[Array] = None, backend: str = "auto", stream: int = 0,
) -> None: ...
def sparse_decode(
    q: Array, k_cache: Array, indices: Array, topk_length: Optional[Array] = None,
    extra_k_cache: Optional[Array] = None, extra_indices: Optional[Array] = None,
    extra_topk_length: Optional[Array] = None, attn_sink: Optional[Array] = None,
    softmax_scale: Optional[float] = None, out: Optional[Array] = None,
    lse: Optional[Array] = None, plan: Optional[Array] = None,
    scratch: Optional[Array] = None, allocate: Optional[Callable[[int], Array]] = None,
    backend: str = "auto", stream: int = 0,
) -> None: ...

def dense_decode_workspace_size(
    q: Array, k_cache: Array, block_table: Array, cache_seqlens: Array, causal: bool = False,
    softmax_scale: Optional[float] = None, out: Optional[Array] = None,
    lse: Optional[Array] = None, backend: str = "auto",
) -> Tuple[int, int]: ...
def dense_decode_supported(
    q: Array, k_cache: Array, block_table: Array, cache_seqlens: Array, causal: bool = False,
    softmax_scale: Optional[float] = None, out: Optional[Array] = None,
    lse: Optional[Array] = None, backend: str = "auto",
) -> Tuple[bool, str, str]: ...
def dense_decode_plan(
    q: Array, k_cache: Array, block_table: Array, cache_seqlens: Array, causal: bool = False,
    softmax_scale: Optional[float] = None, out: Optional[Array] = None,
    lse: Optional[Array] = None, plan: Optional[Array] = None,
    scratch: Optional[Array] = None, backend: str = "auto", stream: int = 0,
) -> None: ...
def dense_decode(
    q: Array, k_cache: Array, block_table: Array, cache_seqlens: Array, causal: bool = False,
    softmax_scale: Optional[float] = None, out: Optional[Array] = None,
    lse: Optional[Array] = None, plan: Optional[Array] = None,
    scratch: Optional[Array] = None, allocate: Optional[Callable[[int], Array]] = None,
    backend: str = "auto", stream: int = 0,
) -> None: ...

def merge_attention(
    out_parts: Array, lse_parts: Array, attn_sink: Optional[Array], out: Array, lse: Array,
    backend: str = "auto", stream: int = 0,
) -> None: ...
def quantize_store(
    src: Array, slots: Array, k_cache: Array, backend: str = "auto", stream: int = 0
) -> None: ...
def dequantize(
    k_cache: Array, slots: Array, out: Array, backend: str = "auto", stream: int = 0
) -> None: ...
def repack_pages(
    src: Array, dst: Array, src_block_table: Array, dst_block_table: Array, seqlens: Array,
    backend: str = "auto", stream: int = 0,
) -> None: ...
