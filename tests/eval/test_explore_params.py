"""ds4lib.eval.explore: the explore notebook's parameters checked with a message naming the bad one."""
import pytest

from ds4lib.eval.explore import BOUNDS, DOMAINS, SIDECAR_DOMAINS, built_sidecars, check_explore_params
from ds4lib.corpus.split import SLICE_PLAN


@pytest.fixture
def files(tmp_path):
    base = tmp_path / "base.gguf"
    base.write_bytes(b"GGUF")
    ck = tmp_path / "ck"
    ck.mkdir()
    return dict(base=str(base), checkpoint=str(ck), domain="none", seed=0)


def test_domains_are_the_slice_plans():
    assert DOMAINS[0] == "none"
    assert set(SIDECAR_DOMAINS) == set(SLICE_PLAN) - {"english"}


def test_good_parameters_pass(files):
    check_explore_params(**files, temperature=0.0, top_p=1.0, top_k=0, max_tokens=48, top_n=5)
    check_explore_params(**{**files, "domain": "law"}, temperature=2.0, top_p=0.05, top_k=200, max_tokens=1024,
                         top_n=20)


@pytest.mark.parametrize("change, message", [
    ({"domain": "nosuch"}, "domain: 'nosuch' is not one of none, finance, code, law, medicine, science"),
    ({"base": "/nonexistent/b.gguf"}, "base: '/nonexistent/b.gguf' is not a file"),
    ({"checkpoint": "/nonexistent"}, "checkpoint: '/nonexistent' is not a directory"),
    ({"seed": 1.5}, "seed: 1.5 is not an integer"),
    ({"temperature": 2.5}, "temperature: 2.5 is outside [0.0, 2.0]"),
    ({"top_p": 0.0}, "top_p: 0.0 is outside [0.05, 1.0]"),
    ({"top_k": 3.0}, "top_k: 3.0 is not an integer"),
    ({"max_tokens": 0}, "max_tokens: 0 is outside [1, 1024]"),
    ({"top_n": True}, "top_n: True is not an integer"),
    ({"temperature": "hot"}, "temperature: 'hot' is not a number"),
])
def test_bad_parameter_is_named(files, change, message):
    args = {**files, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_tokens": 8, "top_n": 5}
    args.update(change)
    with pytest.raises(ValueError) as err:
        check_explore_params(**args)
    assert str(err.value).startswith(message)


def test_unknown_keyword_is_a_caller_error(files):
    assert "beam" not in BOUNDS
    with pytest.raises(TypeError, match="no parameter 'beam'"):
        check_explore_params(**files, beam=4)


def test_built_sidecars_needs_a_manifest(tmp_path):
    (tmp_path / "finance").mkdir()
    (tmp_path / "finance" / "manifest.json").write_text("{}")
    (tmp_path / "law").mkdir()                       # no manifest: not built
    (tmp_path / "nosuch").mkdir()
    (tmp_path / "nosuch" / "manifest.json").write_text("{}")
    assert built_sidecars(tmp_path) == {"finance": tmp_path / "finance"}
    assert built_sidecars(tmp_path / "missing") == {}


def test_committed_sidecars_are_all_found():
    from pathlib import Path
    root = Path(__file__).resolve().parents[2] / "models" / "sidecars"
    assert sorted(built_sidecars(root)) == sorted(SIDECAR_DOMAINS)
