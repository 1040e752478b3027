"""Hugging Face transformers models training: eager, Liger-Kernel, torch.compile and
xpuruntime, one process per mode, from the same weights on the same batches.

The model is transformers' own code (``LlamaForCausalLM`` etc. built from a config in a
published model's shape, random weights, nothing downloaded), trained as its users do:
``model(input_ids=..., labels=...)`` (transformers' own ``ForCausalLMLoss``), bf16
autocast, fused AdamW, one GPU. Each mode runs in a fresh process so that peak memory
and setup time are its own; the parent prints the table with ratios to eager and to
torch.compile.

Modes
-----
eager     the model as written
liger     Liger-Kernel's patches (``apply_liger_kernel_to_<family>()`` before the model
          is built; a benchmark anchor only, never a dependency)
compile   ``torch.compile(model)``
xrt       ``xpt.optimize(model, policy)`` in the user's own loop: the norms that compute
          an RMSNorm on our Triton kernel (Gemma's ``1 + weight`` form too), the MLPs'
          SwiGLU or GeGLU as one Triton pass (keeping only gate and up), the rotary
          embedding as one Triton pass per tensor, each decoder layer's residual add
          and the norm after it as one Triton pass, the attention's q, k and v
          projections and the MLP's gate and up each as one GEMM, the LM
          head fused into the loss (its logits never built, through transformers'
          ``logits.float()``), cuDNN attention
xrt-norope  the same without the rope op (what it adds)
xrt-flash the same with FlashAttention-2 (PyTorch's FLASH backend) instead of cuDNN's
xrt-nores the same with each decoder layer's residual add and norm as written
xrt-unjoined  the same with each projection its own GEMM (what the projections op adds)
xrt-linear  the same with the policy's ``linear`` named ``fused``: every linear layer
          ``ops.fused_linear`` (its weight gradient written by the GEMM, in DDP's bucket
          under ``data_parallel``), none joined
xrt-graph ``xpt.make_train_step(model, loss, optimizer, batch, policy)`` with the same
          kernels, ``precision="bf16"`` and ``cuda_graph=True``: forward, backward and
          AdamW (capturable) replayed as one CUDA graph; the batch a mapping
          (``input_ids``, ``labels``), the loss the model's own (``output.loss``)
xrt-default  ``xpt.optimize(model)``: no policy, what a user writes first
xrt-layers  the same with ``{"graph_layers": True}``: in the same plain loop, each decoder
          layer replays CUDA graphs of its forward and backward
xrt-acn     the same with ``{"autocast_norms": True}``: the norms return bf16, what the
            projections after them cast to
xrt-matmul-<kernel>  the same with the policy's process-wide ``matmul`` named (``cublasLt``,
          ``cublas``, ``default``)
xrt-compile ``xpt.optimize(model)`` (no policy) then ``torch.compile(model)``, the first
          call under compile (our ops trace as registered torch ops)
xrt-compile-fused  the same with the norms, rope and SwiGLU/GeGLU named ``fused`` in the
          policy: our kernels called from the compiled graph (``auto`` under compile
          leaves them to compile's own fusions)
xrt-auto  ``xpt.optimize(model, {"auto_strategy": "best_performance"})``: every op left
          to auto, each call shape's kernels timed on first use; afterwards the
          decisions are frozen into a policy file (``xpt.freeze_kernel_policy()``)
xrt-auto-again  the same in a second process: what the timings kept on disk save
xrt-frozen  ``xpt.optimize(model, <that file>)``: the frozen decisions, nothing measured
xrt-offload  ``xpt.optimize(model, {"offload_activations": True})`` (with
          ``--checkpointing``): each checkpointed layer's input waits in pinned host memory;
          ``xrt-fp8-offload``: the same under ``precision="fp8"`` (a long context's LoRA)
unsloth   Unsloth as its users run it (a benchmark anchor only, never a dependency): the
          same random weights saved in bf16 with a tokenizer, loaded offline by
          ``FastLanguageModel.from_pretrained`` (``load_in_4bit`` with ``--qlora``), the
          adapters by ``FastLanguageModel.get_peft_model`` (needs ``--lora``; dropout 0),
          ``use_gradient_checkpointing=False``; ``unsloth-gc``: ``"unsloth"`` (its
          checkpointing with the activations offloaded to host memory). What to carry to
          the GPU machine: ``scripts/carry-unsloth``
The measurement cache is a fresh directory per run of this script, so that xrt-auto's
setup is a first process's. Every mode collects Python's whole heap before its timed
steps. Setup leaves one full collection pending (about 0.3 s on an H200 host), which
fell in some modes' timed steps and not others'. Each result's ``timing`` gives the
steps' times and the host's time to queue one. A host that runs ahead blocks once the
launch queue is full, so that time alone cannot say which side sets the step.
``ahead_ms`` can: how long the GPU still worked after the host had queued the last step
(near 0: the GPU waited on the host). It also gives the collections in the steps: by
generation, then the longest's and all their milliseconds.
Peak memory is ``torch.cuda.max_memory_allocated()`` over the timed steps, the same way
for every mode (the graphed modes: from the model's load on, its capture included,
where the graph's pool is allocated); one more step gives the peak of each phase
(forward with the loss, backward, optimizer). The first losses of every mode must agree
with eager's within bf16 tolerance (printed).

``--nproc N`` (N > 1) runs each mode under ``torchrun`` on N GPUs of this machine, each
rank training B x T of its own tokens: ``--dist`` names how the model is spread
(``ddp``: ``DistributedDataParallel`` as a user writes it first; ``ddp-view``:
``xpt.distributed.data_parallel``, with ``gradient_as_bucket_view`` and ``static_graph``,
what xrt-graph always uses, the tied embedding's lookup gradient gathered as rows, the
weight gradients computed in DDP's buckets and averaged by NCCL; a LoRA model's adapters
kept whole on every rank without DDP, as ``data_parallel`` chooses for them
(``ddp-reducer``: in DDP's buckets all the same); ``ddp-copy``: the same,
DDP copying and dividing every gradient; ``ddp-dense``: ``ddp-view``, the tied
embedding's gradient all-reduced whole by DDP; ``ddp-bf16``: ``ddp-copy`` with PyTorch's
bf16 gradient-compression hook; ``ddp-lean``, ``ddp-simple``, ``ddp-ll128``: ``ddp-view`` with NCCL on 4 channels (fewer
SMs taken from the backward's kernels), or on the protocol named; ``ddp-prio``: NCCL on a
high-priority stream; ``ddp-reg``: PyTorch's memory registered with NCCL; ``ddp-ch8``,
``ddp-ch16``: NCCL on at most that many channels; ``ddp-eff``: NCCL's efficiency CTA
policy (the fewest CTAs that keep its speed); ``ddp-zero``: ``ddp-view`` with the
optimizer split over the ranks (``xpt.distributed.shard_optimizer``, ZeRO-1), the gathers on
the copy engines (``ddp-zero-sm``: on NCCL's kernels; ``ddp-zero-w1``: one bucket stepped
whole, not two); ``ddp-bN``: ``ddp-view`` with buckets
of N MB (``data_parallel``'s default: a twelfth of the gradients within 25-400 MB,
393 for Llama-1B; DDP's own 25); ``fsdp2``: ``fully_shard`` per decoder layer, then the
model; ``fsdp2-keep``: the layers not resharded after the forward; ``fsdp2-bf16``: the
parameters gathered and computed in bf16, the gradients reduced in fp32 (FSDP2's
``MixedPrecisionPolicy``, as torchtitan trains), the layers resharded after the forward
as ``shard`` chooses (kept gathered where the model is small beside the GPU's memory);
``fsdp2-bf16-reshard``: that, always resharded; ``fsdp2-bf16-gather``: ``fsdp2-bf16``
with every weight gathered in bf16 (under ``precision="fp8"`` the trained weights of the
FP8 GEMMs are gathered in FP8 otherwise: ``shard``'s ``fp8_gather``); all through
``xpt.distributed.shard``; several, comma
separated, each a table). The model is optimized before it is wrapped. Tokens/s count
every rank's; per-GPU efficiency is the 1-GPU step's time (``--single``, the same modes
on one GPU, run first) over the N-GPU step's; peak memory is the largest rank's.

``--checkpointing`` turns on transformers' gradient checkpointing (non-reentrant, as most
fine-tuning recipes do) in every mode. ``--lora R`` trains peft LoRA adapters of rank R
(alpha 2R, dropout 0) on every linear layer of the decoder (q, k, v, o, gate, up, down)
instead of the whole model, in every mode (the optimizer over the adapters alone);
``--lora-dropout P`` gives them dropout P (TRL's default is 0.05). ``--bf16-params``
builds the model in bf16 (a LoRA base as most load it; the whole model trained in bf16
otherwise), autocast unchanged.

FP8 (issue 67): ``xrt-fp8`` and ``xrt-fp8-rowwise`` are ``optimize`` under a policy of
``precision="fp8"`` (``"fp8_rowwise"``): the joined projections' GEMMs (with ``--lora``,
the LoRA groups' frozen base GEMMs; with ``--qlora`` the 4-bit base made FP8 by rows
in place of bf16) with FP8 operands where the shape pays; ``xrt-fp8-base`` (with ``--lora``) also stores the frozen base once in FP8
(``fp8_base``), which those GEMMs read as stored; ``xrt-fp8-base-offload`` (with
``--checkpointing``) keeps the checkpointed inputs in host memory as well, and
``xrt-fp8-base-graph`` is xrt-graph over stored bases. ``xrt-fp8-act`` and
``xrt-fp8-base-act`` are ``xrt-fp8`` and ``xrt-fp8-base`` with the gated MLPs' gate
and up kept in FP8 for the backward (``fp8_activations``), ``xrt-fp8-base-act-graph``
the latter graphed.
``torchao-fp8`` and ``torchao-fp8-rowwise`` swap every linear layer but the head for
torchao's ``Float8Linear`` (that recipe), then ``torch.compile``
(torchao from ``scripts/carry-unsloth``'s wheels). ``llama-8b-8l`` is Llama-3.1-8B's
shape with 8 of its 32 layers (run it with ``--batch 2 --seq 4096 --bf16-params``).

``--rounds N`` runs the modes N times, alternating (A, B, A, B, ...), each run in a fresh
process. Each mode's row is its median run, with the range of its step times beside it.
One H200 host ran the same mode 10% apart in different processes of one call, so a
single run per mode can turn a ratio over. ``--read-loss`` reads each timed step's
loss on the host, as a loop that logs it does: the host can no longer queue steps ahead,
so its own time per step adds to the GPU's wherever it is not hidden within the step.
``--packed N --packed-sequences`` gives every xrt mode's policy ``packed_sequences``
(the documents made from the positions on the device, no host sync a forward); the
graphed modes take packed rows only so, their attention left to auto (our kernel within
the documents; cuDNN would get the dense mask made from them). ``--packed-mixed`` packs
documents of unequal lengths (N/4 to 2N, one seed): Unsloth batches a run of equal
lengths into one SDPA call, so equal documents are its best case.

Usage: python benchmarks/train_hf.py [--models llama-1b,llama-3b,qwen3-1.7b,gemma3-1b,gpt2-124m]
       [--modes eager,liger,compile,xrt,xrt-default,xrt-layers,xrt-unjoined,xrt-norope,xrt-graph,
       xrt-compile,xrt-auto,xrt-auto-again,xrt-frozen,xrt-fp8,xrt-fp8-rowwise,xrt-fp8-offload,xrt-fp8-base,xrt-fp8-base-offload,
       xrt-fp8-base-graph,xrt-fp8-act,xrt-fp8-base-act,xrt-fp8-base-act-graph,torchao-fp8,
       torchao-fp8-rowwise] [--batch 4] [--seq 2048] [--steps 10]
       [--profile 25] [--host-profile 40] [--memory-peak 25] [--no-cache] [--checkpointing] [--lora 16] [--lora-dropout 0.05] [--qlora] [--packed 512 [--packed-mixed] [--packed-sequences]] [--read-loss] [--one-thread]
       [--rounds 3]
       [--nproc 2 --dist ddp,ddp-view,fsdp2 --single xrt]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time

LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SHAPES = {
    # name: (model type, config fields, Liger's patch function)
    "llama-1b": (
        "llama",
        {"vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192,
         "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
         "tie_word_embeddings": True, "rope_theta": 500000.0, "max_position_embeddings": 8192},
        "apply_liger_kernel_to_llama",
    ),
    "llama-3b": (  # Llama-3.2-3B
        "llama",
        {"vocab_size": 128256, "hidden_size": 3072, "intermediate_size": 8192,
         "num_hidden_layers": 28, "num_attention_heads": 24, "num_key_value_heads": 8,
         "tie_word_embeddings": True, "rope_theta": 500000.0, "max_position_embeddings": 8192},
        "apply_liger_kernel_to_llama",
    ),
    "llama-8b": (  # Llama-3.1-8B: untied, for FSDP2 over several GPUs
        "llama",
        {"vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
         "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
         "tie_word_embeddings": False, "rope_theta": 500000.0, "max_position_embeddings": 8192},
        "apply_liger_kernel_to_llama",
    ),
    "llama-8b-8l": (  # Llama-3.1-8B's layers, 8 of its 32 (issue 67's FP8 shape, one GPU)
        "llama",
        {"vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
         "num_hidden_layers": 8, "num_attention_heads": 32, "num_key_value_heads": 8,
         "tie_word_embeddings": False, "rope_theta": 500000.0, "max_position_embeddings": 8192},
        "apply_liger_kernel_to_llama",
    ),
    "qwen3-1.7b": (
        "qwen3",
        {"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
         "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
         "head_dim": 128, "tie_word_embeddings": True, "max_position_embeddings": 8192},
        "apply_liger_kernel_to_qwen3",
    ),
    "gpt2-124m": (
        "gpt2",
        # GPT-2 124M (Conv1D layers, tied head) with a 2048-token context for T2048.
        {"vocab_size": 50257, "n_embd": 768, "n_layer": 12, "n_head": 12, "n_positions": 2048,
         "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
        None,  # Liger-Kernel has no GPT-2 patch
    ),
    "gemma3-1b": (
        "gemma3_text",
        # google/gemma-3-1b-pt's window, 512 (transformers' default is 4096): 22 of the 26
        # layers attend to their last 512 keys
        {"vocab_size": 262144, "hidden_size": 1152, "intermediate_size": 6912,
         "num_hidden_layers": 26, "num_attention_heads": 4, "num_key_value_heads": 1,
         "head_dim": 256, "max_position_embeddings": 8192, "sliding_window": 512},
        "apply_liger_kernel_to_gemma3_text",
    ),
}  # fmt: skip
NCCL_ENV = {  # --dist variants: ddp-view under NCCL settings
    "ddp-lean": {"NCCL_MAX_NCHANNELS": "4"},  # NCCL on fewer SMs
    "ddp-simple": {"NCCL_PROTO": "Simple"},
    "ddp-ll128": {"NCCL_PROTO": "LL128"},
    "ddp-prio": {"TORCH_NCCL_HIGH_PRIORITY": "1"},  # NCCL's stream before the backward's
    "ddp-reg": {"TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK": "1"},  # buffers registered
    "ddp-ch8": {"NCCL_MAX_NCHANNELS": "8"},
    "ddp-ch16": {"NCCL_MAX_NCHANNELS": "16"},
    "ddp-eff": {"NCCL_CTA_POLICY": "1"},  # NCCL's fewest CTAs that keep its speed
}
POLICY = {
    "kernels": {
        "rmsnorm": "fused", "cross_entropy": "fused_linear", "swiglu": "fused",
        "geglu": "fused", "rope": "fused", "residual_rmsnorm": "fused", "attention": "cudnn",
        "projections": "fused",
    }
}  # fmt: skip
# The graphed modes (make_train_step's CUDA graph over POLICY and these fields).
GRAPHED = {
    "xrt-graph": {"precision": "bf16"},
    "xrt-fp8-base-graph": {"precision": "fp8", "fp8_base": True},
    "xrt-fp8-base-act-graph": {"precision": "fp8", "fp8_base": True, "fp8_activations": True},
}


def run_mode(
    name: str,
    mode: str,
    batch: int,
    seq: int,
    steps: int,
    frozen: str,
    profile: int = 0,
    use_cache: bool = True,
    checkpointing: bool = False,
    bf16_params: bool = False,
    lora: int = 0,
    lora_dropout: float = 0.0,
    lora_targets: tuple[str, ...] = LINEAR,
    dist: str = "ddp",
    host_profile: int = 0,
    qlora: bool = False,
    packed: int = 0,
    read_loss: bool = False,
    one_thread: bool = False,
    memory_peak: int = 0,
    packed_sequences: bool = False,
    packed_mixed: bool = False,
) -> dict:
    """One mode in this process: setup, checked first losses, timed steps, peak memory
    (``frozen``: the policy file xrt-auto writes and xrt-frozen reads; ``profile``: how
    many of the GPU kernels that took most time over two more steps to print)."""
    if mode.startswith("unsloth"):
        os.environ["HF_HUB_OFFLINE"] = "1"  # read when huggingface_hub is imported
        import unsloth  # noqa: F401  (before transformers and peft, which it patches)
    import torch
    from torch.profiler import record_function
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, fields, liger = SHAPES[name]
    start = time.perf_counter()
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    rank = 0
    for key, value in NCCL_ENV.get(dist, {}).items():  # read when NCCL starts
        os.environ.setdefault(key, value)
    if distributed:
        from xpuruntime import pytorch as xpt

        xpt.distributed.init_distributed()  # NCCL, this rank's GPU
        rank = xpt.distributed.rank()
    device = torch.device("cuda", torch.cuda.current_device())
    if mode == "liger":
        import liger_kernel.transformers as lk

        getattr(lk, liger)()
    config = AutoConfig.for_model(model_type, **fields, use_cache=use_cache)
    torch.manual_seed(0)
    with device:  # initialised where it trains (seconds, not a minute)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model.train()
    if bf16_params:
        model.to(torch.bfloat16)
    if mode.startswith("unsloth"):
        model = unsloth_model(
            model, seq, lora, qlora, lora_targets, checkpointing=mode == "unsloth-gc"
        )
    elif qlora:
        four_bit(model, device)
    if lora and not mode.startswith("unsloth"):
        from peft import LoraConfig, get_peft_model

        adapters = LoraConfig(
            r=lora,
            lora_alpha=2 * lora,
            lora_dropout=lora_dropout,
            target_modules=list(lora_targets),
        )
        model = get_peft_model(model, adapters)
    if checkpointing and not mode.startswith("unsloth"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    torch.cuda.reset_peak_memory_stats()  # (not the fp32 initialisation's: 8B's 30 GiB)
    report = None
    if mode.startswith("xrt"):
        from xpuruntime import pytorch as xpt

        policy = POLICY
        if mode == "xrt-norope":
            policy = {"kernels": {k: v for k, v in POLICY["kernels"].items() if k != "rope"}}
        elif mode == "xrt-nores":
            policy = {"kernels": {**POLICY["kernels"], "residual_rmsnorm": "torch"}}
        elif mode == "xrt-linear":
            policy = {"kernels": {**POLICY["kernels"], "linear": "fused"}}
        elif mode == "xrt-unjoined":
            policy = {"kernels": {**POLICY["kernels"], "projections": "torch"}}
        elif mode == "xrt-flash":
            policy = {"kernels": {**POLICY["kernels"], "attention": "flash_v2"}}
        elif mode.startswith("xrt-auto"):
            policy = {"auto_strategy": "best_performance"}
        elif mode == "xrt-frozen":
            policy = frozen
        elif mode in ("xrt-default", "xrt-compile"):
            policy = None
        elif mode == "xrt-layers":  # the default, each decoder layer replaying CUDA graphs
            policy = {"graph_layers": True}
        elif mode == "xrt-compile-fused":  # our elementwise kernels inside the compiled graph
            elementwise = ("rmsnorm", "residual_rmsnorm", "rope", "geglu", "swiglu")
            policy = {"kernels": dict.fromkeys(elementwise, "fused")}
        elif mode in ("xrt-fp8", "xrt-fp8-rowwise"):  # the joined projections' GEMMs in FP8
            policy = {"precision": mode.removeprefix("xrt-").replace("-", "_")}
        elif mode == "xrt-offload":  # the default, checkpointed inputs in host memory
            policy = {"offload_activations": True}
        elif mode == "xrt-fp8-offload":  # both: a long context's LoRA step
            policy = {"precision": "fp8", "offload_activations": True}
        elif mode == "xrt-fp8-base":  # LoRA's frozen base stored once in FP8
            policy = {"precision": "fp8", "fp8_base": True}
        elif mode == "xrt-fp8-base-offload":  # the same, checkpointed inputs in host memory
            policy = {"precision": "fp8", "fp8_base": True, "offload_activations": True}
        elif mode == "xrt-fp8-act":  # FP8, gate and up kept in FP8 for the backward
            policy = {"precision": "fp8", "fp8_activations": True}
        elif mode == "xrt-fp8-base-act":  # both: a LoRA step's least memory without offload
            policy = {"precision": "fp8", "fp8_base": True, "fp8_activations": True}
        elif mode == "xrt-acn":  # the default, the norms returning autocast's dtype
            policy = {"autocast_norms": True}
        elif mode.startswith("xrt-matmul-"):  # the default, with the process-wide BLAS named
            policy = {"kernels": {"matmul": mode.removeprefix("xrt-matmul-")}}
        if packed_sequences:  # every batch given positions read as packed, on the device
            policy = with_packed_sequences(policy)
        if mode not in GRAPHED:
            report = xpt.optimize(model, policy)
    graphed = mode in GRAPHED
    if distributed:
        model = spread(model, dist, device, graphed)
    if mode.startswith("torchao-fp8"):  # torchao's Float8Linear swap, then compile
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        recipe = "rowwise" if mode.endswith("rowwise") else "tensorwise"
        convert_to_float8_training(
            model, config=Float8LinearConfig.from_recipe_name(recipe),
            module_filter_fn=lambda module, fqn: "lm_head" not in fqn,
        )  # fmt: skip
    compiled = mode in ("compile", "xrt-compile", "xrt-compile-fused") or mode.startswith(
        "torchao-fp8"
    )
    forward = torch.compile(model) if compiled else model
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=1e-5, fused=True, capturable=graphed)
    if dist == "ddp-zero-w1":  # one bucket stepped whole, not two
        from xpuruntime.pytorch.distributed import _zero as _optimizer_shards

        _optimizer_shards.WHOLE_FIRST = 1
    if distributed and dist.startswith("ddp-zero"):
        xpt.distributed.shard_optimizer(
            model, optimizer, copy_engines=None if dist == "ddp-zero" else False
        )
    generator = torch.Generator().manual_seed(1 + 1000 * rank)  # each rank its own tokens
    data = [
        torch.randint(0, config.vocab_size, (batch, seq), generator=generator).to(device)
        for _ in range(4)
    ]

    extra = {}  # the forward's other inputs
    if packed:  # TRL's padding-free batches: one row, positions restarting per document
        if batch * seq % packed and not packed_mixed:
            raise SystemExit("--packed: B x T must be whole documents")
        if graphed and not packed_sequences:
            raise SystemExit("--packed with a graphed mode needs --packed-sequences (a graph "
                             "cannot hold transformers' look at the positions)")  # fmt: skip
        data = [ids.view(1, -1) for ids in data]
        lengths = document_lengths(batch * seq, packed, packed_mixed)
        positions = torch.cat([torch.arange(n) for n in lengths]).to(device)
        extra["position_ids"] = positions[None]
        starts = positions == 0

    def labelled(ids):  # no target across a document's start (TRL's collator)
        if not packed:
            return ids
        labels = ids.clone()
        labels[:, starts] = -100
        return labels

    clock = PhaseClock(torch) if host_profile else None

    def step(ids):  # its phases named for a trace (benchmarks/trace_gaps.py)
        with torch.autocast("cuda", torch.bfloat16), record_function("forward"):
            loss = forward(input_ids=ids, labels=labelled(ids), **extra).loss
        if clock:
            clock.mark("forward")
        with record_function("backward"), torch.autograd.set_multithreading_enabled(not one_thread):
            loss.backward()
        if clock:
            clock.mark("backward")
        with record_function("optimizer"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if clock:
            clock.mark("optimizer")
        return loss

    if graphed:  # the model's own loss from labels (its head fused into it), as step()'s
        policy = {**POLICY, **GRAPHED[mode], "cuda_graph": True}
        if packed_sequences:
            policy = with_packed_sequences(policy)
        named = ("swiglu", "geglu") if policy.get("fp8_activations") else ()  # (auto's order)
        # Attention within the documents, or a sliding window that cuts the row (Gemma3-1B's
        # 512 at T2048), on our kernel: not cuDNN's on a dense mask.
        slides = "sliding_attention" in (getattr(config, "layer_types", None) or ())
        window = getattr(config, "sliding_window", None)
        if packed_sequences or (slides and isinstance(window, int) and window < seq):
            named += ("attention",)
        policy["kernels"] = {k: v for k, v in POLICY["kernels"].items() if k not in named}
        train_step, report = xpt.make_train_step(
            model,
            lambda output, _: output.loss,
            optimizer,
            {"input_ids": data[0], "labels": labelled(data[0]), **extra},
            policy,
        )

        def step(ids):
            return train_step({"input_ids": ids, "labels": labelled(ids), **extra})

    losses = [step(data[i % len(data)]).item() for i in range(3)]  # warm-up, compiles
    torch.cuda.synchronize()
    setup = time.perf_counter() - start
    if not graphed:  # a graph's pool is allocated in its capture: its peak is from the load on
        torch.cuda.reset_peak_memory_stats()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    marks = [torch.cuda.Event(enable_timing=True) for _ in range(steps)]

    def timed_steps():  # named for scripts/host-spy, which samples only these
        for i in range(steps):
            loss = step(data[i % len(data)])
            marks[i].record()
            if read_loss:  # a loop that logs each step's loss waits for it
                loss.item()

    # A collection of the whole heap falls once, early, for what setup left (about 0.3 s
    # on an H200 host: 30% on a 10-step mean). Made here in every mode, not in one
    # mode's timed steps by chance.
    gc.collect()
    before, collections = torch.cuda.memory_stats(), [g["collections"] for g in gc.get_stats()]
    pauses, started = [], [0.0]  # each collection's host milliseconds in the timed steps

    def collecting(phase, info):
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses.append((time.perf_counter() - started[0]) * 1e3)

    gc.callbacks.append(collecting)
    queued = time.perf_counter()
    begin.record()
    timed_steps()
    end.record()
    done = time.perf_counter()
    queued = done - queued
    gc.callbacks.remove(collecting)
    torch.cuda.synchronize()
    ahead = time.perf_counter() - done  # (the GPU's work left when the host had queued all)
    after = torch.cuda.memory_stats()
    churn = sum(after.get(k, 0) - before.get(k, 0) for k in ("num_device_alloc", "num_device_free"))
    # What moves a step between processes: each step's time, the host's time to queue
    # one, the allocator's trips to the device and Python's collections in the steps
    # (by generation, and the longest one's and all their host milliseconds).
    timing = {
        "step_ms": [round(a.elapsed_time(b), 1) for a, b in zip([begin, *marks], marks)],
        "host_ms": round(queued * 1e3 / steps, 1),
        "ahead_ms": round(ahead * 1e3, 1),
        "device_allocs": churn,
        "gc": [g["collections"] - c for g, c in zip(gc.get_stats(), collections)],
        "gc_ms": [round(max(pauses, default=0.0), 1), round(sum(pauses), 1)],
    }
    peak = torch.cuda.max_memory_allocated() / 2**30
    measured = None
    if mode == "xrt-auto":
        from xpuruntime.pytorch._selection._policy import current_state
        from xpuruntime.pytorch._selection._routed import ROUTED_OPS

        xpt.freeze_kernel_policy().save(frozen)
        decisions = [
            *current_state().decisions.items(),  # process-wide: matmul, conv
            *((op, d) for op, routed in ROUTED_OPS.items() for d in routed.decisions.values()),
        ]
        measured = sorted({f"{op}: {d.chosen}, {d.reason[:160]}" for op, d in decisions})
    if profile:
        print_profile(lambda: [step(data[i % len(data)]) for i in range(2)], profile)
    if host_profile:
        print_host_profile(
            lambda: [step(data[i % len(data)]) for i in range(2)], host_profile, clock
        )
    if memory_peak:
        print_memory_peak(lambda: step(data[0]), memory_peak)
    phases = {}  # where the peak is: one more step, its phases' peaks apart
    ids = data[0]
    if distributed:  # the largest rank's peak; the ranks step together
        largest = torch.tensor(peak, device=device)
        torch.distributed.all_reduce(largest, op=torch.distributed.ReduceOp.MAX)
        peak = float(largest)
    if graphed or distributed:  # one replay, or ranks: no phases told apart
        return {
            "ms": begin.elapsed_time(end) / steps,
            "peak_gib": peak,
            "setup_s": setup,
            "losses": losses,
            "report": str(report).splitlines()[0],
            "timing": timing,
        }
    torch.cuda.reset_peak_memory_stats()
    with torch.autocast("cuda", torch.bfloat16):
        loss = forward(input_ids=ids, labels=labelled(ids), **extra).loss
    phases["forward"] = torch.cuda.max_memory_allocated() / 2**30
    torch.cuda.reset_peak_memory_stats()
    loss.backward()
    phases["backward"] = torch.cuda.max_memory_allocated() / 2**30
    torch.cuda.reset_peak_memory_stats()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    phases["optimizer"] = torch.cuda.max_memory_allocated() / 2**30
    return {
        "ms": begin.elapsed_time(end) / steps,
        "peak_gib": peak,
        "setup_s": setup,
        "losses": losses,
        "peak_gib_by_phase": {k: round(v, 2) for k, v in phases.items()},
        "report": None if report is None else str(report).splitlines()[0],
        **({"measured": measured} if measured else {}),
        "timing": timing,
    }


def document_lengths(tokens: int, length: int, mixed: bool) -> list[int]:
    """The lengths of the documents packed in a row of ``tokens``: each ``length``, or
    (``mixed``) drawn from ``length // 4`` to ``2 * length - 1`` by one seed, the last
    cut to fit (the same in every mode and process)."""
    if not mixed:
        return [length] * (tokens // length)
    draw, lengths = random.Random(7), []
    while sum(lengths) < tokens:
        lengths.append(min(draw.randrange(length // 4, 2 * length), tokens - sum(lengths)))
    return lengths


def with_packed_sequences(policy):
    """``policy`` (None, a mapping, a ``KernelPolicy`` or its file) with
    ``packed_sequences`` on."""
    if policy is None or isinstance(policy, dict):
        return {**(policy or {}), "packed_sequences": True}
    from xpuruntime.policies import KernelPolicy

    if not isinstance(policy, KernelPolicy):
        policy = KernelPolicy.load(policy)
    return KernelPolicy.from_dict({**policy.to_dict(), "packed_sequences": True})


def unsloth_model(model, seq: int, lora: int, qlora: bool, targets, checkpointing: bool):
    """``model``'s weights through Unsloth, as its users load and adapt a model: saved in
    bf16 with a word-level tokenizer, loaded by ``FastLanguageModel.from_pretrained``,
    adapters by its ``get_peft_model`` (r ``lora``, alpha 2r, dropout 0, on ``targets``),
    offline."""
    import torch
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    from unsloth import FastLanguageModel

    if not lora:
        raise SystemExit("unsloth: a LoRA mode (--lora R)")
    folder = tempfile.mkdtemp(prefix="unsloth-model-")
    model.to(torch.bfloat16).save_pretrained(folder)
    vocab = {f"t{i}": i for i in range(model.config.vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0", pad_token="t0",
                            eos_token="t1", bos_token="t2").save_pretrained(folder)  # fmt: skip
    del model
    torch.cuda.empty_cache()
    model, _ = FastLanguageModel.from_pretrained(
        folder, max_seq_length=seq, dtype=torch.bfloat16, load_in_4bit=qlora
    )
    model = FastLanguageModel.get_peft_model(
        model, r=lora, lora_alpha=2 * lora, lora_dropout=0, bias="none",
        target_modules=list(targets), use_gradient_checkpointing="unsloth" if checkpointing else False,
    )  # fmt: skip
    model.train()
    return model


def four_bit(model, device) -> None:
    """Every decoder linear layer of ``model`` replaced by bitsandbytes' ``Linear4bit``
    holding its weights in nf4 (bf16 compute), as QLoRA's quantized loading makes them."""
    import bitsandbytes as bnb
    import torch

    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is torch.nn.Linear and child_name.endswith("_proj"):
                quantized = bnb.nn.Linear4bit(
                    child.in_features, child.out_features, bias=child.bias is not None,
                    compute_dtype=torch.bfloat16, quant_type="nf4", device="meta",
                )  # fmt: skip
                quantized.weight = bnb.nn.Params4bit(
                    child.weight.data.cpu(), requires_grad=False, quant_type="nf4"
                )
                setattr(module, child_name, quantized.to(device))
    model.is_loaded_in_4bit = True  # what peft reads to wrap the layers as QLoRA's


def spread(model, dist: str, device, graphed: bool):
    """``model`` spread over the job's ranks as ``dist`` names (see the module's doc)."""

    if dist.startswith("ddp"):
        from torch.nn.parallel import DistributedDataParallel

        from xpuruntime import pytorch as xpt

        if dist == "ddp-dense":  # the tied embedding's gradient reduced whole, by DDP
            wrapped = xpt.distributed.data_parallel(model, embedding_rows=False)
        elif dist == "ddp-reducer":  # DDP's reducer even for a LoRA model's adapters
            wrapped = xpt.distributed.data_parallel(model, replicate_trained=False)
        elif dist in ("ddp-copy", "ddp-bf16"):  # DDP copies (and divides) every gradient
            wrapped = xpt.distributed.data_parallel(model, gradients_in_buckets=False)
        elif graphed or dist in ("ddp-view", "ddp-zero", "ddp-zero-sm", "ddp-zero-w1", *NCCL_ENV):
            wrapped = xpt.distributed.data_parallel(model)  # static graph, buckets as grads
        elif dist.startswith("ddp-b") and dist[5:].isdigit():  # buckets of that many MB
            wrapped = xpt.distributed.data_parallel(model, bucket_cap_mb=int(dist[5:]))
        else:
            wrapped = DistributedDataParallel(model, device_ids=[device])
        if dist == "ddp-bf16":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            wrapped.register_comm_hook(None, default_hooks.bf16_compress_hook)
        return wrapped
    if dist in ("fsdp2", "fsdp2-keep", "fsdp2-bf16", "fsdp2-bf16-reshard", "fsdp2-bf16-gather"):
        from xpuruntime import pytorch as xpt  # per layer, then all

        return xpt.distributed.shard(
            model,
            precision="bf16" if dist.startswith("fsdp2-bf16") else "fp32",
            reshard_after_forward={"fsdp2": True, "fsdp2-keep": False}.get(
                dist, True if dist.endswith("-reshard") else None
            ),
            fp8_gather=False if dist == "fsdp2-bf16-gather" else None,
        )
    raise SystemExit(f"--dist: unknown {dist!r}")


def print_profile(run, rows: int) -> None:
    """The ``rows`` GPU kernels that took most time in ``run()``, per step (ms), to
    stderr (stdout carries the mode's result); with ``XRT_TRACE_DIR`` set, every kernel
    as a Chrome trace there, one file per rank."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    traced = bool(os.environ.get("XRT_TRACE_DIR"))
    activities = [ProfilerActivity.CUDA, *([ProfilerActivity.CPU] if traced else [])]
    with profile(activities=activities) as prof:
        run()
        torch.cuda.synchronize()
    if traced:  # the two steps as a Chrome trace per rank, host ops too (trace_gaps.py)
        rank = os.environ.get("RANK", "0")
        prof.export_chrome_trace(os.path.join(os.environ["XRT_TRACE_DIR"], f"rank{rank}.json"))
    kernels = sorted(
        (e for e in prof.key_averages() if e.device_type.name == "CUDA"),
        key=lambda e: -e.self_device_time_total,
    )
    total = sum(e.self_device_time_total for e in kernels) / 2e3
    comm = sum(e.self_device_time_total for e in kernels if "nccl" in e.key.lower()) / 2e3
    print(f"  GPU kernels per step: {total:.1f} ms ({comm:.1f} ms of them NCCL's)", file=sys.stderr)
    for e in kernels[:rows]:
        per_step = e.self_device_time_total / 2e3
        print(f"  {per_step:7.2f} ms {e.count // 2:5d}x  {e.key[:110]}", file=sys.stderr)


_OURS = ("xpuruntime", "peft", "transformers", "train_hf", "torch/distributed")


def live_at_peak(trace: list[dict]) -> tuple[int, list[tuple[int, int, str]]]:
    """The most bytes live at once in a CUDA allocator trace (``torch.cuda.memory.
    _snapshot()["device_traces"][device]``, allocations made while it recorded), and
    what was live then: ``(bytes, count, where)`` per place, largest first. A place is
    the innermost frame in xpuruntime, peft, transformers, FSDP2 or this file."""

    def replayed(until: int) -> tuple[dict[int, dict], int, int]:
        # (what is live after entry `until`, the most bytes live, the entry where)
        live: dict[int, dict] = {}
        total = peak = last = 0
        for i, entry in enumerate(trace[: until + 1]):
            if entry["action"] == "alloc":
                live[entry["addr"]] = entry
                total += entry["size"]
                if total > peak:
                    peak, last = total, i
            elif entry["action"] == "free_completed" and entry["addr"] in live:
                total -= live.pop(entry["addr"])["size"]
        return live, peak, last

    _, peak, last = replayed(len(trace))
    live, _, _ = replayed(last)  # (a second pass: no copy of what is live at each new peak)
    groups: dict[str, list[int]] = {}
    for entry in live.values():
        frames = entry.get("frames") or []
        ours = [f for f in frames if any(part in f["filename"] for part in _OURS)]
        frame = (ours or frames or [{"filename": "?", "line": 0, "name": "?"}])[0]
        where = f"{frame['filename'].rsplit('/', 1)[-1]}:{frame['line']} {frame['name']}"
        group = groups.setdefault(where, [0, 0])
        group[0] += entry["size"]
        group[1] += 1
    return peak, sorted(((b, n, w) for w, (b, n) in groups.items()), reverse=True)


def print_memory_peak(run, rows: int) -> None:
    """What was live at the GPU memory's peak in ``run()`` beyond what lived before it
    (parameters, optimizer state): the ``rows`` largest places it was allocated, to
    stderr, from each rank (a rank's lines carry its number)."""
    import torch

    rank = os.environ.get("RANK", "0")
    before = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    try:
        run()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    peak, places = live_at_peak(snapshot["device_traces"][torch.cuda.current_device()])
    print(f"  rank {rank}: {before / 2**30:.2f} GiB live before the step, at most "
          f"{peak / 2**30:.2f} GiB more during it:", file=sys.stderr)  # fmt: skip
    for size, count, where in places[:rows]:
        print(f"  rank {rank}: {size / 2**20:9.1f} MiB {count:5d}x  {where[:110]}", file=sys.stderr)


class PhaseClock:
    """Each phase's host time to queue it and the GPU's time from the phase's start to
    its end (CUDA events: idle time included), summed from :meth:`start` and told per
    step of the two that :func:`print_host_profile` runs by :meth:`stop`."""

    def __init__(self, torch) -> None:
        self.torch, self.on, self.host, self.gpu, self.last = torch, False, {}, {}, None

    def start(self) -> None:
        self.on, self.host, self.gpu = True, {}, {}
        self.last = (time.perf_counter(), self._event())

    def mark(self, phase: str) -> None:
        if not self.on:
            return
        now, event = time.perf_counter(), self._event()
        then, before = self.last
        self.host[phase] = self.host.get(phase, 0.0) + (now - then) * 1e3
        self.gpu.setdefault(phase, []).append((before, event))
        self.last = (now, event)

    def stop(self) -> str:
        self.torch.cuda.synchronize()
        self.on = False
        return ", ".join(
            f"{phase} {self.host[phase] / 2:.1f} host / "
            f"{sum(a.elapsed_time(b) for a, b in pairs) / 2:.1f} GPU"
            for phase, pairs in self.gpu.items()
        )

    def _event(self):
        event = self.torch.cuda.Event(enable_timing=True)
        event.record()
        return event


def print_host_profile(run, rows: int, phases: PhaseClock | None = None) -> None:
    """The host's time to queue ``run()`` (two steps; the GPU synchronised after), each
    phase's host and GPU time, any stream sync the steps wait for, and the ``rows`` Python
    functions with the most time of their own under ``cProfile`` and the ``rows`` with the
    most time with what they call, to stderr. Under
    several ranks each rank says its phases and host time (its lines carry its number),
    rank 0 alone its functions."""
    import cProfile
    import io
    import pstats
    import warnings

    import torch

    rank = int(os.environ.get("RANK", "0"))
    who = f"rank {rank} " if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
    torch.cuda.synchronize()
    begin = time.perf_counter()
    run()  # unprofiled first: the host's own time to queue the two steps
    unprofiled = time.perf_counter() - begin
    if phases is not None:
        phases.start()
        run()
        print(f"  {who}per step, ms: {phases.stop()}", file=sys.stderr)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    # (the first call of set_sync_debug_mode warns that it is a prototype: not counted)
    said = (w for w in caught if "called a synchronizing" in str(w.message))
    syncs = [f"{w.filename}:{w.lineno}" for w in said]
    print(f"  {who}stream syncs in two steps: {len(syncs)}, at {sorted(set(syncs))}",
          file=sys.stderr)  # fmt: skip
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    begin = time.perf_counter()
    profiler.enable()
    run()
    profiler.disable()
    queued = time.perf_counter() - begin
    torch.cuda.synchronize()
    print(
        f"  {who}host time per step: {unprofiled * 500:.1f} ms ({queued * 500:.1f} ms profiled)",
        file=sys.stderr,
    )
    if rank == 0:
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text)
        stats.sort_stats("tottime").print_stats(rows)
        stats.sort_stats("cumulative").print_stats(rows)
        print(text.getvalue(), file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="llama-1b")
    parser.add_argument("--modes", default="eager,liger,compile,xrt")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument(
        "--no-cache",
        action="store_true",
        help="config.use_cache=False (transformers then builds no KV cache while training)",
    )
    parser.add_argument(
        "--checkpointing", action="store_true", help="gradient checkpointing (non-reentrant)"
    )
    parser.add_argument(
        "--bf16-params", action="store_true", help="the model's parameters in bf16, not fp32"
    )
    parser.add_argument("--lora", type=int, default=0, help="peft LoRA of this rank")
    parser.add_argument(
        "--qlora", action="store_true", help="with --lora: the base in bitsandbytes' nf4"
    )
    parser.add_argument(
        "--read-loss", action="store_true", help="each timed step's loss read on the host"
    )
    parser.add_argument(
        "--one-thread", action="store_true",
        help="plain loops' backward on the calling thread, not autograd's device thread "
        "(torch.autograd.set_multithreading_enabled(False), as make_train_step's eager step)",
    )  # fmt: skip
    parser.add_argument(
        "--packed", type=int, default=0, help="documents of this length packed in one row"
    )
    parser.add_argument(
        "--packed-mixed", action="store_true",
        help="with --packed N: documents of N/4 to 2N tokens (one seed), not all N",
    )  # fmt: skip
    parser.add_argument(
        "--packed-sequences", action="store_true",
        help="with --packed: the xrt modes' policies say every batch is packed",
    )  # fmt: skip
    parser.add_argument("--lora-dropout", type=float, default=0.0, help="the adapters' dropout")
    parser.add_argument(
        "--lora-targets", default=",".join(LINEAR),
        help="the adapted projections (q_proj,v_proj: peft's default for Llama)",
    )  # fmt: skip
    parser.add_argument("--nproc", type=int, default=1, help="GPUs (torchrun) per mode")
    parser.add_argument("--dist", default="ddp", help="with --nproc: how the model is spread")
    parser.add_argument("--single", default="", help="with --nproc: modes run on 1 GPU too")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # name:mode, in a child process
    parser.add_argument("--frozen", help=argparse.SUPPRESS)  # the frozen policy's file
    parser.add_argument("--profile", type=int, default=0, help="print this many top kernels")
    parser.add_argument(
        "--rounds", type=int, default=1,
        help="run the modes this many times, alternating; each mode's median step (and range)",
    )  # fmt: skip
    parser.add_argument(
        "--host-profile", type=int, default=0,
        help="each phase's host and GPU time (every rank's under --nproc), then this many top "
        "Python functions (rank 0's)",
    )  # fmt: skip
    parser.add_argument(
        "--memory-peak", type=int, default=0,
        help="print this many places of what one more step holds at its peak (every rank)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.one:
        name, mode = args.one.split(":")
        result = run_mode(
            name, mode, args.batch, args.seq, args.steps, args.frozen, args.profile,
            use_cache=not args.no_cache, checkpointing=args.checkpointing, lora=args.lora,
            bf16_params=args.bf16_params,
            lora_dropout=args.lora_dropout, lora_targets=tuple(args.lora_targets.split(",")),
            dist=args.dist, host_profile=args.host_profile, qlora=args.qlora,
            read_loss=args.read_loss, one_thread=args.one_thread,
            packed=args.packed, memory_peak=args.memory_peak,
            packed_sequences=args.packed_sequences, packed_mixed=args.packed_mixed,
        )  # fmt: skip
        if int(os.environ.get("RANK", "0")) == 0:
            print(json.dumps(result))
        return
    import torch

    scratch = tempfile.mkdtemp(prefix="train_hf-")
    os.environ["XPURUNTIME_CACHE_DIR"] = os.path.join(scratch, "cache")  # for the children

    packing = ", no padding or packing"
    if args.packed:
        sizes = f"{args.packed // 4}-{2 * args.packed - 1}" if args.packed_mixed else args.packed
        packing = f", packed: documents of {sizes} tokens in one row, positions restarting"
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, B{args.batch} x "
          f"T{args.seq}, bf16 autocast, fused AdamW, {args.steps} timed steps"
          + (", gradient checkpointing" if args.checkpointing else "")
          + (", bf16 parameters" if args.bf16_params else "")
          + (f", peft LoRA r={args.lora} on "
             + ("all linear layers" if args.lora_targets == ",".join(LINEAR) else args.lora_targets)
             if args.lora else "")
          + (", base in bitsandbytes nf4 (QLoRA)" if args.qlora else "")
          + (", each step's loss read on the host" if args.read_loss else "")
          + (", backward on the calling thread" if args.one_thread else "")
          + packing
          + (f", LoRA dropout {args.lora_dropout}" if args.lora and args.lora_dropout else ""))  # fmt: skip
    for name in args.models.split(","):
        if args.nproc == 1:
            modes = args.modes.split(",")
            runs = {mode: [] for mode in modes}
            for _ in range(args.rounds):  # alternating, so that a host's drift hits all alike
                for mode in modes:
                    runs[mode].append(launch(args, scratch, name, mode))
            results = {mode: median_run(found) for mode, found in runs.items()}
            print_table(name, args.batch * args.seq, results, None)
            continue
        alone = [mode for mode in args.single.split(",") if mode]
        spread = [(dist, mode) for dist in args.dist.split(",") for mode in args.modes.split(",")]
        runs = {key: [] for key in (*alone, *spread)}
        for _ in range(args.rounds):  # alternating, one GPU's runs among the several's
            for mode in alone:
                runs[mode].append(launch(args, scratch, name, mode))
            for dist, mode in spread:
                runs[dist, mode].append(launch(args, scratch, name, mode, args.nproc, dist))
        single = {mode: median_run(runs[mode]) for mode in alone}
        for dist in args.dist.split(","):
            results = {mode: median_run(runs[d, mode]) for d, mode in spread if d == dist}
            title = f"{name}, {dist}, {args.nproc} GPUs"
            print_table(title, args.batch * args.seq * args.nproc, results, single)


def launch(args, scratch: str, name: str, mode: str, nproc: int = 1, dist: str = "ddp"):
    """One mode in a child process (``nproc`` > 1: under torchrun); its result or None."""
    if mode == "liger" and SHAPES[name][2] is None:
        print(f"{name} liger: skipped (Liger-Kernel has no patch for this family)")
        return None
    if mode in GRAPHED and dist.startswith("fsdp2"):
        print(f"{name} {mode} ({dist}): skipped (FSDP2's collectives are not captured)")
        return None
    if mode in GRAPHED and dist.startswith("ddp-zero"):
        print(f"{name} {mode} ({dist}): skipped (a graph cannot replay the split step's gathers)")
        return None
    runner = [sys.executable]
    if nproc > 1:
        runner += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    command = [*runner, __file__, "--one", f"{name}:{mode}", "--batch", str(args.batch),
         "--seq", str(args.seq), "--steps", str(args.steps), "--profile", str(args.profile),
         "--host-profile", str(args.host_profile), "--memory-peak", str(args.memory_peak),
         "--frozen", os.path.join(scratch, f"{name}-frozen.json"),
         *(["--no-cache"] if args.no_cache else []),
         *(["--checkpointing"] if args.checkpointing else []),
         *(["--bf16-params"] if args.bf16_params else []),
         *(["--qlora"] if args.qlora else []),
         *(["--read-loss"] if args.read_loss else []),
         *(["--one-thread"] if args.one_thread else []),
         "--packed", str(args.packed),
         *(["--packed-sequences"] if args.packed_sequences else []),
         *(["--packed-mixed"] if args.packed_mixed else []),
         "--lora", str(args.lora), "--lora-dropout", str(args.lora_dropout),
         "--lora-targets", args.lora_targets, "--dist", dist]  # fmt: skip
    # A session of its own, so that nothing it started outlives it into the next mode's
    # run (compile workers, a tool's helpers), sharing the host's CPUs with that run.
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as process:  # fmt: skip
        out, err = process.communicate()
    child = subprocess.CompletedProcess(command, process.returncode, out, err)
    where = f"{name} {mode}" + (f" ({dist}, {nproc} GPUs)" if nproc > 1 else "")
    if outlived(process.pid):
        print(f"{where}: processes it started were still running after it (killed)")
    lines = [line for line in child.stdout.splitlines() if line.startswith("{")]
    if child.returncode != 0 or not lines:
        said = [ln for ln in child.stderr.splitlines() if "Error" in ln and "elastic" not in ln]
        tail = (said[-1] if said else " ".join(child.stderr.strip().splitlines()[-3:]))[:300]
        print(f"{where}: failed ({tail})")
        return None
    result = json.loads(lines[-1])
    print(f"{where}: {json.dumps(result)}", flush=True)
    ours = [ln for ln in child.stderr.splitlines()
            if "Warning:" in ln and ("xpuruntime" in ln or "optimize:" in ln)]  # fmt: skip
    for line in dict.fromkeys(ours):  # (what the library warned the run of, once each)
        print(f"  {where} was warned: {line.strip()[:400]}")
    if args.profile:
        print(
            "\n".join(ln for ln in child.stderr.splitlines() if ln.startswith("  ") and " ms" in ln)
        )
    if args.host_profile:  # from the first phases said on (any rank's)
        found = re.search(r"^  (rank \d+ )?per step, ms", child.stderr, re.M)
        print(child.stderr[found.start() :] if found else child.stderr[-2000:])
    if args.memory_peak:
        print("\n".join(ln for ln in child.stderr.splitlines() if ln.startswith("  rank ")))
    return result


def outlived(session: int) -> bool:
    """Whether processes of a finished child's session (its id: the child's pid) were
    still running; they are killed."""
    try:
        os.killpg(session, signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


def median_run(runs: list) -> dict | None:
    """The run of median step time among ``runs`` (None where none ran), with the range
    of their step times where there were several."""
    done = sorted((r for r in runs if r is not None), key=lambda r: r["ms"])
    if not done:
        return None
    middle = dict(done[(len(done) - 1) // 2])
    if len(done) > 1:
        middle["ms_range"] = (done[0]["ms"], done[-1]["ms"])
    return middle


def print_table(title: str, tokens: int, results: dict, single: dict | None) -> None:
    """The modes' table; with ``single`` (1-GPU results), per-GPU efficiency."""
    results = {mode: r for mode, r in results.items() if r is not None}
    scaled = "per-GPU eff" if single is not None else "vs eager"
    # Unsloth's row, where it ran: its checkpointed mode beside a checkpointed run.
    anchor = next((results[m] for m in ("unsloth-gc", "unsloth") if m in results), None)
    unsloth = " vs Unsloth (time, peak) |" if anchor else ""
    print(f"\n## {title}\n| mode | ms/step | tokens/s | {scaled} | vs compile |{unsloth} "
          f"peak GiB | setup s | first losses |\n| --- | ---: | ---: | ---: | ---: |"
          f"{' ---: |' if anchor else ''} ---: | ---: | --- |")  # fmt: skip
    for mode, r in results.items():
        if single is None:
            first = _ratio(results.get("eager"), r)
        else:  # the same mode's 1-GPU step, else xrt's
            first = _ratio(single.get(mode) or single.get("xrt"), r)
        vs = _ratio(results.get("compile"), r)
        losses = ", ".join(f"{x:.4f}" for x in r["losses"])
        beside = ""
        if anchor:
            beside = f" {anchor['ms'] / r['ms']:.2f}x, {r['peak_gib'] / anchor['peak_gib']:.2f}x |"
        spread = " ({:.1f}-{:.1f})".format(*r["ms_range"]) if "ms_range" in r else ""
        print(f"| {mode} | {r['ms']:.1f}{spread} | {tokens / r['ms'] * 1e3:,.0f} | {first} "
              f"| {vs} |{beside} {r['peak_gib']:.2f} | {r['setup_s']:.1f} | {losses} |")  # fmt: skip


def _ratio(anchor: dict | None, result: dict) -> str:
    """The anchor's step time over the result's, or a dash where the anchor did not run."""
    return "-" if anchor is None else f"{anchor['ms'] / result['ms']:.2f}x"


if __name__ == "__main__":
    main()
