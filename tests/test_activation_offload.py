"""Activation offload (the policy's ``offload_activations``): a checkpointed layer's
input waits in host memory between its forward and its backward, and the model trains
exactly as with transformers' own checkpointing: the same losses and gradients, with
bf16 autocast, with dropout (the recompute draws the forward's masks), and under peft
LoRA, whose frozen embeddings give the layers no input that requires a gradient."""

from __future__ import annotations

import pickle

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import xpuruntime as xrt  # noqa: E402
from xpuruntime import pytorch as xpt  # noqa: E402

pytestmark = pytest.mark.usefixtures("clean_kernel_policy")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
POLICY = {"offload_activations": True}


def _pair(dropout: float = 0.0, lora: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, attention_dropout=dropout,
        use_cache=False,
    )  # fmt: skip
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
        if lora:
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(target_modules="all-linear", lora_dropout=0))
            for name, p in model.named_parameters():
                if "lora_B" in name:  # trained adapters: B is not zero
                    torch.nn.init.normal_(p, std=0.1)
        model.to(DEVICE).train()
        model.gradient_checkpointing_enable({"use_reentrant": False})
        models.append(model)
    return models


def _step(model, seed: int = 3):
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    torch.manual_seed(seed)
    with torch.autocast(DEVICE, torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach().float(), grads


@pytest.mark.parametrize(
    ("dropout", "lora"), [(0.0, False), (0.2, False), (0.0, True)], ids=["plain", "dropout", "lora"]
)
def test_offloaded_checkpoints_train_as_transformers_checkpointing(dropout, lora):
    offloaded, reference = _pair(dropout, lora)
    report = xpt.optimize(offloaded, {**POLICY, "kernels": {"rmsnorm": "torch"}})
    assert len(report.offloaded_checkpoints) == 3, str(report)
    assert "offloaded 3 checkpointed layer input(s)" in str(report).splitlines()[0]
    loss, grads = _step(offloaded)
    want_loss, want = _step(reference)
    torch.testing.assert_close(loss, want_loss, atol=1e-3, rtol=1e-3)
    assert grads.keys() == want.keys() and grads
    for name in want:
        torch.testing.assert_close(grads[name], want[name], atol=2e-3, rtol=2e-2, msg=name)


def test_offload_needs_checkpointing_on_and_revert_puts_transformers_function_back():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    model = LlamaForCausalLM(config)
    report = xpt.optimize(model, POLICY)
    assert any("gradient_checkpointing_enable" in why for _, why in report.skipped)
    report.revert()
    model.gradient_checkpointing_enable()
    written = model.model.layers[0]._gradient_checkpointing_func
    report = xpt.optimize(model, POLICY)
    assert model.model.layers[0]._gradient_checkpointing_func is not written
    offload = model.model.layers[0]._gradient_checkpointing_func
    assert type(pickle.loads(pickle.dumps(offload))) is type(offload)  # a fresh one
    report.revert()
    assert model.model.layers[0]._gradient_checkpointing_func is written


def test_the_policy_takes_saves_and_names_offload_activations(tmp_path):
    policy = xrt.KernelPolicy(offload_activations=True)
    assert xrt.KernelPolicy.load(policy.save(tmp_path / "p.json")).offload_activations
    assert "offload_activations=True" in repr(policy)
    assert "offload_activations" not in xrt.KernelPolicy().to_dict()  # fingerprints kept
    with pytest.raises(xrt.PolicyError, match="offload_activations"):
        xrt.KernelPolicy(offload_activations="yes")
