import dataclasses
import json

import pytest

import xpuruntime as xrt


def test_kernel_policy_set_get_remove_chain():
    policy = xrt.KernelPolicy(matmul="cublasLt").set("attention", "flash_v2")
    assert policy.get("matmul") == "cublasLt"
    assert policy.remove("matmul").get("matmul") is None
    assert policy.preferences == {"attention": "flash_v2"}


def test_kernel_policy_names_are_case_insensitive_and_canonicalised():
    assert xrt.KernelPolicy(matmul="CUBLASLT").get("MatMul") == "cublasLt"


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"matmull": "cublas"}, "'matmul'"),
        ({"matmul": "magma"}, "'cublasLt'"),
        ({"auto_strategy": "fastest"}, "'best_performance'"),
        ({"matmul": 3}, "got 3"),
    ],
)
def test_kernel_policy_rejects_unknown_values_listing_choices(kwargs, needle):
    with pytest.raises(xrt.PolicyError, match=needle):
        xrt.KernelPolicy(**kwargs)


def test_fingerprint_is_independent_of_argument_order_and_changes_with_content():
    a = xrt.KernelPolicy(matmul="cublasLt", attention="cudnn")
    b = xrt.KernelPolicy(attention="cudnn", matmul="cublasLt")
    assert a.fingerprint() == b.fingerprint()
    assert a.fingerprint() != b.set("attention", "math").fingerprint()


@pytest.mark.parametrize("suffix", [".json", ".yaml", ".yml"])
def test_kernel_policy_round_trips_through_files(tmp_path, suffix):
    policy = xrt.KernelPolicy(
        matmul="cublas", conv="cudnn_benchmark", auto_strategy="best_performance"
    )
    path = policy.save(tmp_path / f"policy{suffix}")
    assert xrt.KernelPolicy.load(path) == policy
    assert not list(tmp_path.glob(".*tmp"))  # the atomic write left no temporary


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_frozen_decisions_round_trip_through_files_and_change_the_fingerprint(tmp_path, suffix):
    plain = xrt.KernelPolicy(auto_strategy="best_performance", attention="math")
    policy = xrt.KernelPolicy.from_dict(plain.to_dict())
    policy.freeze("layernorm", {"dtype": "bf16", "rows": 8192, "n": 2048}, "fused", "measured")
    policy.freeze("Cross_Entropy", {"shapes": ((4, 5), (6, 7))}, "torch")
    assert policy.fingerprint() != plain.fingerprint()
    assert "frozen" not in plain.to_dict()  # a policy without any keeps its old form
    loaded = xrt.KernelPolicy.load(policy.save(tmp_path / f"policy{suffix}"))
    assert loaded == policy and loaded.fingerprint() == policy.fingerprint()
    # looked up by value, whatever the key order or tuple/list spelling
    assert loaded.frozen_for("layernorm", {"n": 2048, "rows": 8192, "dtype": "bf16"}) == {
        "op": "layernorm", "shape_class": {"dtype": "bf16", "n": 2048, "rows": 8192},
        "kernel": "fused", "reason": "measured",
    }  # fmt: skip
    assert loaded.frozen_for("cross_entropy", {"shapes": [[4, 5], [6, 7]]})["kernel"] == "torch"
    assert loaded.frozen_for("layernorm", {"rows": 8192}) is None
    assert "2 frozen decision(s)" in repr(loaded)


@pytest.mark.parametrize(
    "frozen, needle",
    [
        ("layernorm=fused", "'frozen' must be a list"),
        ([{"op": "layernorm", "kernel": "fused"}], "frozen decision 0: expected a mapping"),
        ([{"op": "nope", "shape_class": {}, "kernel": "fused"}], "nope"),
        ([{"op": "layernorm", "shape_class": {}, "kernel": "flash_v9"}], "fused"),
        ([{"op": "layernorm", "shape_class": [1], "kernel": "fused"}], "must be a mapping"),
        ([{"op": "layernorm", "shape_class": {}, "kernel": "fused", "why": 1}], "optionally"),
        ([{"op": "layernorm", "shape_class": {"n": float("nan")}, "kernel": "fused"}],
         "plain JSON data"),
    ],
)  # fmt: skip
def test_a_bad_frozen_decision_is_refused_naming_it(frozen, needle):
    with pytest.raises(xrt.PolicyError, match=needle):
        xrt.KernelPolicy.from_dict({"frozen": frozen})


def test_malformed_policy_file_names_the_file(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"kernels": {"matmul": ')
    with pytest.raises(xrt.PolicyError, match="bad.json: malformed JSON"):
        xrt.KernelPolicy.load(path)


def test_policy_file_with_unknown_kernel_names_file_and_choices(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("kernels:\n  attention: flash_v9\n")
    with pytest.raises(xrt.PolicyError, match=r"p.yaml: .*flash_v2"):
        xrt.KernelPolicy.load(path)


def test_missing_policy_file_and_unknown_suffix(tmp_path):
    with pytest.raises(xrt.PolicyError, match="not found"):
        xrt.KernelPolicy.load(tmp_path / "absent.json")
    with pytest.raises(xrt.PolicyError, match="suffix"):
        xrt.KernelPolicy().save(tmp_path / "policy.txt")


def test_yaml_top_level_must_be_a_mapping(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- matmul\n")
    with pytest.raises(xrt.PolicyError, match="expected a mapping"):
        xrt.KernelPolicy.load(path)


def test_execution_policy_validates_every_field():
    cases = {
        "engine": "tensorflow",
        "device": "tpu:0",
        "precision": "fp8",
        "strict": "yes",
        "threads": 0,
        "accuracy": {"rtol": -1},
        "auto_strategy": "fast",
        "providers": ["rocm"],
        "optimization_level": "max",
    }
    for field, value in cases.items():
        with pytest.raises(xrt.PolicyError, match=field if field != "device" else "device"):
            xrt.ExecutionPolicy(**{field: value})


# Values a red team fed each field: every one is a PolicyError naming the field, never
# numpy's or Python's own exception from deeper down (a new field must be listed here).
_HOSTILE_FIELD_VALUES = {
    "engine": ["", None, 3, "onnxrt\0"],
    "device": ["", None, "cuda:-1", "cpu:x", "tpu"],
    "precision": [None, "FP8", 16],
    "strict": [1, "true", None],
    "cache_dir": [3, b"bytes", "cache\0dir"],
    "threads": [True, -1, 1025, 2.0, 2**70],
    "accuracy": [
        3,
        {"seed": -1},
        {"seed": 2**64},
        {"seed": 1.5},
        {"rtol": float("nan")},
        {"atol": float("inf")},
        {"atol": 10**400},
        {"atol": "1e-3"},
        {"typo": 1},
        {"metric": "l3"},
        {"metric": "max_abs"},  # its bound is in the model's units: never a default
        {"metric": "rel_l2", "threshold": -0.1},
        {"metric": "rel_l2", "threshold": float("nan")},
        {"metric": "top1_agreement", "threshold": 1.5},
        {"threshold": 0.1},  # allclose is bounded by rtol and atol
    ],
    "auto_strategy": ["", None, "fastest"],
    "providers": ["cpu", [], ["cpu", "cpu"], [3], 3],
    "optimization_level": [None, 99, "max"],
    "cuda_graph": [1, "yes"],
    "kernels": [3, "conv", {"conv": "nope"}, {"typo": 1}],
    "performance": [None, "fast", 1],
    "static_shapes": [1, "yes", None],
    "request_batch": [0, -1, True, 2.0, "64", None, 10**6],
    "unquantized_precision": [None, "fp16", "int8", 1],
}


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(xrt.ExecutionPolicy)])
def test_every_policy_field_refuses_hostile_values_with_a_policy_error_naming_it(field):
    values = _HOSTILE_FIELD_VALUES[field]
    for value in values:
        with pytest.raises(xrt.PolicyError) as raised:
            xrt.ExecutionPolicy(**{field: value})
        named = field if field not in ("kernels",) else "kernel"
        assert named in str(raised.value) or field == "device", (value, str(raised.value))


def test_execution_policy_normalises_aliases_and_round_trips(tmp_path):
    policy = xrt.ExecutionPolicy(
        engine="ONNXRuntime",
        device="CUDA",
        precision="FP32",
        accuracy={"rtol": 1e-2},
        providers=["cuda", "cpu"],
    )
    assert (policy.engine, policy.device) == ("onnxrt", "cuda:0")
    assert policy.accuracy == xrt.AccuracyPolicy(rtol=1e-2)
    for suffix in (".json", ".yaml"):
        assert xrt.ExecutionPolicy.load(policy.save(tmp_path / f"p{suffix}")) == policy
    assert json.loads(json.dumps(policy.to_dict()))["providers"] == ["cuda", "cpu"]


def test_execution_policy_fingerprint_ignores_cache_dir_only():
    a = xrt.ExecutionPolicy(cache_dir="/tmp/a")
    assert a.fingerprint() == xrt.ExecutionPolicy(cache_dir="/tmp/b").fingerprint()
    assert a.fingerprint() != xrt.ExecutionPolicy(precision="default").fingerprint()


def test_execution_policy_replace_rejects_unknown_fields():
    with pytest.raises(xrt.PolicyError, match="unknown field"):
        xrt.ExecutionPolicy().replace(engines="onnxrt")


def test_execution_policy_cuda_graph_needs_a_cuda_device(mlp_model):
    with pytest.raises(xrt.PolicyError, match="cuda_graph: needs a CUDA device"):
        xrt.InferenceSession(mlp_model, device="cpu", policy={"cuda_graph": True})
    with pytest.raises(xrt.PolicyError, match="cuda_graph: expected True or False"):
        xrt.ExecutionPolicy(device="cuda", cuda_graph="yes")


def test_execution_policy_kernels_take_the_short_and_the_full_form_and_round_trip():
    short = xrt.ExecutionPolicy(device="cuda", kernels={"conv": "cudnn_benchmark"})
    full = xrt.ExecutionPolicy(device="cuda", kernels=xrt.KernelPolicy(conv="cudnn_benchmark"))
    assert short == full and short.fingerprint() == full.fingerprint()
    assert xrt.ExecutionPolicy.from_dict(short.to_dict()) == short
    assert short.fingerprint() != xrt.ExecutionPolicy(device="cuda").fingerprint()
    with pytest.raises(xrt.PolicyError, match="conv"):
        xrt.ExecutionPolicy(kernels={"conv": "fastest"})
