"""Hypothesis strategies for KV layer mixes (shared by the layout tests)."""

from __future__ import annotations

from hypothesis import strategies as st

from raykv.layout import MLA, ChunkedLocal, CrossAttention, FullAttention, Mamba, SlidingWindow

heads = st.sampled_from([1, 2, 4, 8, 16])
head_dims = st.sampled_from([32, 64, 128, 256])
dtypes = st.sampled_from(["bfloat16", "float16", "float32", "float8_e4m3fn"])


def _attention(cls: type[FullAttention], **extra: st.SearchStrategy) -> st.SearchStrategy:
    """``cls`` (FullAttention or a subclass) with drawn heads, head_dim, dtype and ``extra``."""
    return st.builds(cls, num_kv_heads=heads, head_dim=head_dims, dtype=dtypes, **extra)


full = _attention(FullAttention)
sliding = _attention(SlidingWindow, window=st.integers(1, 4096))
chunked = _attention(ChunkedLocal, chunk=st.integers(1, 4096))
cross = _attention(CrossAttention, max_encoder_len=st.integers(1, 2048))
mla = st.builds(
    MLA,
    kv_lora_rank=st.sampled_from([128, 256, 512]),
    qk_rope_head_dim=st.sampled_from([32, 64]),
    dtype=dtypes,
)
mamba = st.builds(
    Mamba,
    state_shapes=st.tuples(
        st.tuples(st.sampled_from([64, 256, 1024]), st.integers(1, 4)),
        st.tuples(st.sampled_from([64, 256, 1024]), st.sampled_from([16, 64, 128])),
    ),
    dtype=st.sampled_from(["bfloat16", "float32"]),
)
any_spec = st.one_of(full, sliding, chunked, cross, mla, mamba)


@st.composite
def layer_mixes(draw, max_layers: int = 24):
    """Layer name -> spec: a few distinct specs, each repeated over several layers."""
    palette = draw(st.lists(any_spec, min_size=1, max_size=4))
    n = draw(st.integers(1, max_layers))
    picks = draw(st.lists(st.integers(0, len(palette) - 1), min_size=n, max_size=n))
    return {f"layers.{i}": palette[p] for i, p in enumerate(picks)}
