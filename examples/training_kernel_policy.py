"""Train a small transformer for a few steps under a kernel policy and summarise the
dispatch log: which kernel ran each matmul and attention, forward and backward, and why.

Runs on a CPU (fp32 -> bf16 autocast on the CPU) and on a CUDA GPU (bf16 autocast).

    python examples/training_kernel_policy.py
"""

from collections import Counter

import torch

from xpuruntime import pytorch as xpt


class Block(torch.nn.Module):
    def __init__(self, dim: int = 128, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim, bias=False)
        self.proj = torch.nn.Linear(dim, dim)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attn = xpt.ops.fused_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.norm2(x))


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = torch.nn.Sequential(Block(), Block()).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.randn(8, 64, 128, device=device)

    policy = {"matmul": "cublasLt", "attention": "flash_v2"}  # falls back on a CPU, says why
    with xpt.kernel_policy({"kernels": policy}):
        print(xpt.explain_kernel_policy(), "\n")
        xpt.enable_dispatch_logging()
        for step in range(3):
            with xpt.autocast(dtype=torch.bfloat16):
                loss = model(data).float().pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            print(f"step {step}: loss {loss.item():.4f}")
        xpt.disable_dispatch_logging()

    ran = Counter(
        (r.op, r.chosen, r.source, r.context["phase"], r.context["precision"])
        for r in xpt.get_dispatch_logs()
        if "aten_op" in r.context
    )
    print(f"\n{'op':10} {'kernel':10} {'source':9} {'phase':9} {'precision':14} calls")
    for (op, kernel, source, phase, precision), calls in sorted(ran.items()):
        print(f"{op:10} {kernel:10} {source:9} {phase:9} {precision:14} {calls}")
    fallbacks = {r.reason for r in xpt.get_dispatch_logs() if r.source == "fallback"}
    for reason in sorted(fallbacks):
        print(f"fallback: {reason}")


if __name__ == "__main__":
    main()
