import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import xpuruntime as xrt


@pytest.fixture(scope="module")
def session(two_input_model):
    return xrt.InferenceSession(two_input_model)


def good():
    return {"a": np.ones((2, 4), np.float32), "ids": np.ones((2, 3), np.int64)}


@pytest.mark.parametrize(
    "feeds, needle",
    [
        ({"a": np.ones((2, 4), np.float32)}, r"missing input\(s\) \['ids'\]"),
        ({**good(), "b": np.ones(1)}, r"unknown input name\(s\) \['b'\]"),
        ({**good(), "a": np.ones((2, 4, 1), np.float32)}, "'a': expected rank 2"),
        ({**good(), "a": np.ones((2, 5), np.float32)}, "'a': dimension 1 must be 4"),
        ({**good(), "a": np.ones((2, 4), np.float64)}, "'a': expected dtype float32, got float64"),
        ({**good(), "ids": np.ones((2, 3), np.float32)}, "'ids': expected dtype int64"),
        ({**good(), "a": [[1.0] * 4] * 2}, "'a': expected a numpy array or a DLPack tensor"),
        ({**good(), "ids": np.ones((3, 3), np.int64)}, "'batch'.* input 'a' set 'batch' = 2"),
        ([np.ones((2, 4), np.float32)], r"expected 2 input\(s\)"),
        ("a", "expected a dict"),
    ],
)
def test_wrong_inputs_name_the_input_and_what_was_expected(session, feeds, needle):
    with pytest.raises(xrt.InvalidInputError, match=needle):
        session.run(feeds)


def test_lossless_widening_is_converted(session):
    feeds = {"a": np.ones((2, 4), np.float16), "ids": np.ones((2, 3), np.int32)}
    (out,) = session.run(feeds)
    assert out.dtype == np.float32 and np.allclose(out, 6.0)  # 1 * sum of all six ids


def test_positional_inputs_and_non_contiguous_arrays(session):
    a = np.arange(16, dtype=np.float32).reshape(4, 4)[::2]
    (out,) = session.run([a, np.ones((2, 3), np.int64)])
    assert np.array_equal(out, a * 6)


class ForeignTensor:
    """A DLPack producer that is not numpy (what torch, CuPy and JAX look like)."""

    def __init__(self, array):
        self._array = array

    def __dlpack__(self, **kwargs):
        return self._array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._array.__dlpack_device__()


def test_any_host_dlpack_producer_is_read(session):
    feeds = {
        "a": ForeignTensor(np.full((1, 4), 2, np.float32)),
        "ids": ForeignTensor(np.ones((1, 3), np.int64)),
    }
    (out,) = session.run(feeds)
    assert np.array_equal(out, np.full((1, 4), 6, np.float32))


_dtypes = st.sampled_from(
    [
        np.float16,
        np.float32,
        np.float64,
        np.int8,
        np.int32,
        np.int64,
        np.uint8,
        np.uint64,
        np.bool_,
        np.complex64,
    ]
)
_arrays = st.builds(
    lambda shape, dtype: np.zeros(shape, dtype),
    st.lists(st.integers(0, 5), min_size=0, max_size=4).map(tuple),
    _dtypes,
)
_values = st.one_of(
    _arrays, st.none(), st.integers(), st.text(max_size=3), st.lists(st.floats(), max_size=3)
)


@settings(
    max_examples=300, suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None
)
@given(a=_values, ids=_values, extra=st.booleans(), drop=st.sampled_from([None, "a", "ids"]))
def test_random_wrong_inputs_raise_invalid_input_and_never_crash(session, a, ids, extra, drop):
    feeds = {"a": a, "ids": ids}
    if extra:
        feeds["zzz"] = a
    if drop:
        del feeds[drop]
    try:
        outputs = session.run(feeds)
    except xrt.InvalidInputError:
        return
    # Only a valid feed may get through, and then the result must be right.
    assert isinstance(a, np.ndarray) and a.shape[1:] == (4,) and a.shape[0] == ids.shape[0]
    assert outputs[0].shape == a.shape


def test_generated_inputs_follow_metadata_and_seed(two_input_model):
    from xpuruntime.inference import Model, generate_inputs

    specs = Model.load(two_input_model).inputs
    one, two = generate_inputs(specs, seed=5), generate_inputs(specs, seed=5)
    assert one["a"].shape == (1, 4) and one["ids"].dtype == np.int64
    assert all(np.array_equal(one[k], two[k]) for k in one)
    with pytest.raises(xrt.InvalidInputError, match="unknown input"):
        generate_inputs(specs, shapes={"nope": (1,)})


@settings(
    max_examples=300, suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None
)
@given(a=_values, ids=_values, extra=st.booleans(), as_list=st.booleans())
def test_fast_path_validator_agrees_with_full_validation(session, a, ids, extra, as_list):
    from xpuruntime.inference import InputValidator, validate_inputs

    if as_list:
        feeds = [a, ids, *([a] if extra else [])]
    else:
        feeds = {"a": a, "ids": ids, **({"zzz": a} if extra else {})}
    outcomes = []
    for check in (InputValidator(session.inputs), lambda f: validate_inputs(session.inputs, f)):
        try:
            outcomes.append({k: (v.dtype, v.shape, v.tobytes()) for k, v in check(feeds).items()})
        except xrt.InvalidInputError as e:
            outcomes.append(str(e))
    assert outcomes[0] == outcomes[1]


def test_conforming_feeds_pass_through_without_copies(session):
    from xpuruntime.inference import InputValidator

    feeds = good()
    checked = InputValidator(session.inputs)(feeds)
    assert all(checked[k] is feeds[k] for k in feeds)
    in_order = [feeds[spec.name] for spec in session.inputs]
    checked = InputValidator(session.inputs)(in_order)
    assert all(checked[spec.name] is x for spec, x in zip(session.inputs, in_order))
    strided = {**good(), "a": np.ones((2, 8), np.float32)[:, ::2]}
    assert InputValidator(session.inputs)(strided)["a"].flags.c_contiguous
