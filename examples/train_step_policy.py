"""Build a whole training step from one policy file and train a tiny language model.

The policy says which kernels run (fused layer norms, the LM head and its loss fused
without materialising the logits), the precision (bf16 autocast) and, on a GPU, that
the step (forward, backward, gradient clipping, AdamW) is captured as one CUDA graph.
Runs on a CUDA GPU, and on a CPU as an eager step where ``auto`` takes PyTorch's kernels
(Triton's run on a CPU only under TRITON_INTERPRET=1: correct, but minutes here).

    python examples/train_step_policy.py
"""

import tempfile
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

import xpuruntime as xrt
from xpuruntime import pytorch as xpt


class TinyLM(torch.nn.Module):
    def __init__(self, vocab: int = 512, dim: int = 128, context: int = 64) -> None:
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, dim)
        self.wpe = torch.nn.Embedding(context, dim)
        self.ln = torch.nn.LayerNorm(dim)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim)
        )
        self.ln_f = torch.nn.LayerNorm(dim)
        self.lm_head = torch.nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        torch.nn.init.normal_(self.wte.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        x = x + self.mlp(self.ln(x))
        return self.lm_head(self.ln_f(x))


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def main() -> None:
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    policy_file = Path(tempfile.mkdtemp()) / "train_step.json"
    xrt.KernelPolicy(
        precision="bf16",
        cuda_graph=cuda,
        layernorm="auto",
        cross_entropy="auto",
    ).save(policy_file)
    print(f"policy: {xrt.KernelPolicy.load(policy_file)}")

    torch.manual_seed(0)
    model = TinyLM().to(device)
    lr = torch.tensor(3e-3, device=device) if cuda else 3e-3
    opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=cuda, capturable=cuda)
    tokens = torch.randint(0, 512, (16, 65))
    batch = (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step, report = xpt.make_train_step(model, loss_fn, opt, batch, policy_file,
                                           max_grad_norm=1.0)  # fmt: skip
        losses = [float(step(batch)) for _ in range(30)]
    print(report)
    print(f"step: {type(step).__name__}; loss {losses[0]:.3f} -> {losses[-1]:.3f} in 30 steps")
    for w in {str(w.message) for w in caught}:
        print(f"note: {w}")
    print(xpt.explain_kernel_policy())
    report.revert()


if __name__ == "__main__":
    main()
