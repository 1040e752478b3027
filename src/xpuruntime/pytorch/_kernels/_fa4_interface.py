"""FlashAttention-4's kernels in the form PyTorch's FA4 hook calls them.

``torch.nn.attention``'s FA4 hook imports a module exposing ``_flash_attn_fwd`` and
``_flash_attn_bwd`` and unpacks two results from the forward; flash-attn-4 4.0.0b36
returns five (the output, the log-sum-exp and three values for other callers; measured
on the H200 with torch 2.11: ``ValueError: too many values to unpack``). This module is
the one the hook is pointed at: FA4's own functions, their results cut to what the hook
takes. Imported only when ``flash_v4`` is activated.
"""

from flash_attn.cute import interface as _fa4


def _flash_attn_fwd(*args, **kwargs):
    out = _fa4._flash_attn_fwd(*args, **kwargs)
    return out[0], out[1]


def _flash_attn_bwd(*args, **kwargs):
    return _fa4._flash_attn_bwd(*args, **kwargs)[:3]
