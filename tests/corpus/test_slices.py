"""The committed fitting/judging slices: sizes, token/text consistency, disjointness, stratification."""
import itertools
import json
import shutil

import numpy as np
import pytest

from ds4lib.corpus.slices import MAX_TOKENS, MIN_TOKENS, SLICES_DIR, SliceError, load_slice
from ds4lib.corpus.split import ROLES, SLICE_PLAN, WINDOW_TOKENS, slice_names
from ds4lib.tokenizer import TOKENIZER_DIR, load_tokenizer

DOMAINS = ("finance", "code", "law", "medicine", "science", "english")


@pytest.fixture(scope="module")
def slices():
    return {n: load_slice(n) for n in slice_names()}


def test_every_domain_has_fit_and_judge():
    assert sorted(slice_names()) == sorted(f"{d}/{r}" for d in DOMAINS for r in ("fit", "judge"))


def test_sizes(slices):
    for name, s in slices.items():
        assert MIN_TOKENS <= s.n_tokens <= MAX_TOKENS, name
        assert s.tokens.ndim == 2 and s.tokens.shape[1] == WINDOW_TOKENS
        assert len(s.text) == len(s.strata) == s.tokens.shape[0]
        assert s.tokens.min() >= 0 and s.tokens.max() < 8192
        assert (name.split("/")[0], name.split("/")[1]) == (s.domain, s.role)


def test_text_re_encodes_to_tokens(slices):
    tok = load_tokenizer()
    for name, s in slices.items():
        for i, text in enumerate(s.text):
            assert tok.encode(text, add_special_tokens=False).ids == s.tokens[i].tolist(), (name, i)
            assert tok.decode(s.tokens[i].tolist(), skip_special_tokens=False) == text


def _gcide_entry(key):
    source, doc_id = key.split(":", 1)
    return int(doc_id.split(" ", 1)[0]) if source.endswith("/gcide") else None


def test_documents_disjoint(slices):
    for s in slices.values():
        assert set(s.documents) <= set(s.reserved)
        assert len(set(s.reserved)) == len(s.reserved)
    for a, b in itertools.combinations(slices.values(), 2):
        assert not set(a.reserved) & set(b.reserved), (a.name, b.name)
        ea = {_gcide_entry(k) for k in a.reserved} - {None}
        eb = {_gcide_entry(k) for k in b.reserved} - {None}
        assert not ea & eb, (a.name, b.name)        # one dictionary entry feeds one slice at most


def test_stratified_over_sub_sources(slices):
    for domain, strata in SLICE_PLAN.items():
        for role in ROLES:
            s = slices[f"{domain}/{role}"]
            counts = {st.name: s.strata.count(st.name) for st in strata}
            assert counts == {st.name: st.windows for st in strata}
            assert len(strata) >= 3


def test_index_matches(slices):
    index = json.loads((SLICES_DIR / "index.json").read_text())
    assert set(index["slices"]) == set(slices)
    for name, s in slices.items():
        assert index["slices"][name]["tokens"] == s.n_tokens


def test_load_slice_rejects_unknown_name_and_other_tokenizer(tmp_path):
    with pytest.raises(SliceError):
        load_slice("finance/train")
    other = tmp_path / "tokenizer.json"
    shutil.copyfile(TOKENIZER_DIR / "tokenizer.json", other)
    other.write_text(other.read_text(encoding="utf-8") + " ", encoding="utf-8")
    with pytest.raises(SliceError):
        load_slice("finance/judge", tokenizer_path=other)
    assert np.array_equal(load_slice("finance/judge").tokens, load_slice("finance/judge").tokens)
