"""Builder steps on small synthetic sources: deterministic output, the parsing rules, the exclusion rule."""
import gzip
import json
import struct
import zlib

import numpy as np
import pytest

from ds4lib.corpus.build import COMMITTED_MANIFEST, load_manifest
from ds4lib.corpus.definitions import definition_conversations, render_definition_chats
from ds4lib.corpus.dictionary import field_domain, gcide_documents, read_gcide, wordnet_documents
from ds4lib.corpus.document import Document, documents_sha256, normalise_text, read_documents, write_documents
from ds4lib.corpus.fetch import file_sha256
from ds4lib.corpus.markup import html_to_text, info_nodes, man_is_redirect
from ds4lib.corpus.pins import PINS
from ds4lib.corpus.rserialize import RDataError, read_lazyload_strings
from ds4lib.corpus.slices import SliceError, cut_windows
from ds4lib.corpus.sources import SOURCES
from ds4lib.corpus.split import Reservation
from ds4lib.corpus.training import MIXTURE, Exclusion, TrainingSet
from ds4lib.tokenizer import TOKENIZER_DIR, load_tokenizer, tokenizer_sha256

GCIDE_ENTRIES = [
    'Ledger \\Ledg"er\\ (l[e^]j"[~e]r), n. [Akin to D. legger layer,\n'
    '   daybook.]\n'
    '   1. (Com.) A book in which a summary of accounts is laid up\n'
    '      or preserved. [Written also {leger}.]\n'
    '      [1913 Webster]\n\n'
    '   2. (Arch.) A large flat stone, esp. one laid over a tomb.\n'
    '      [1913 Webster]\n\n'
    '   {Ledger wall} (Mining), the wall under a vein.\n'
    '      [1913 Webster]\n',
    'Heron \\Her"on\\, n. (Zool.)\n'
    '   Any long-necked wading bird of the family {Ardeid[ae]}.\n'
    '   [1913 Webster]\n',
    'Tort \\Tort\\, n. [F. tort.]\n'
    '   1. (Law) Any civil wrong, other than a breach of contract.\n'
    '      [1913 Webster]\n\n'
    '   2. Mischief; injury; calamity. [Obs.] --Spenser.\n'
    '      [1913 Webster]\n',
    'DJIA \\DJIA\\ (d[=e]j), n. (Finance) The Dow Jones Industrial Average. [acronym]\n'
    '   [PJC]\n',
]


def _b64(n):
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    out = ""
    while True:
        out = alphabet[n % 64] + out
        n //= 64
        if not n:
            return out


def _write_gcide(folder):
    folder.mkdir()
    text, index = "00-database-short\n   test\n\n", []
    for entry in GCIDE_ENTRIES:
        off = len(text.encode())
        text += entry + "\n"
        index.append(f"{entry.split(' ')[0]}\t{_b64(off)}\t{_b64(len(entry.encode()))}")
    (folder / "gcide.dict.dz").write_bytes(gzip.compress(text.encode(), mtime=0))
    (folder / "gcide.index").write_text("00-database-short\tA\tB\n" + "\n".join(sorted(index)) + "\n")
    return folder


def test_gcide_split_by_field_and_deterministic(tmp_path):
    folder = _write_gcide(tmp_path / "gcide")
    by_domain = {d: list(gcide_documents(read_gcide(folder), d, f"{d}/gcide"))
                 for d in ("finance", "science", "law", "general", "medicine")}
    texts = {d: [doc.text for doc in docs] for d, docs in by_domain.items()}
    assert texts["finance"] == ["Ledger, n.\n1. (Com.) A book in which a summary of accounts is laid up or preserved. "
                                "[Written also leger.]",
                                "DJIA, n.\n(Finance) The Dow Jones Industrial Average."]
    assert texts["science"] == ["Heron, n.\nAny long-necked wading bird of the family Ardeidæ."]
    assert texts["law"] == ["Tort, n.\n1. (Law) Any civil wrong, other than a breach of contract."]
    assert texts["general"] == ["Ledger, n.\n2. (Arch.) A large flat stone, esp. one laid over a tomb.\n"
                                "Ledger wall (Mining), the wall under a vein.",
                                "Tort, n.\n2. Mischief; injury; calamity. [Obs.] --Spenser."]
    assert texts["medicine"] == []
    assert by_domain["science"][0].meta["group"] == "zoology"
    assert by_domain["finance"][0].meta["entry"] == by_domain["general"][0].meta["entry"]
    again = list(gcide_documents(read_gcide(folder), "general", "general/gcide"))
    assert documents_sha256(again) == documents_sha256(by_domain["general"])


def test_field_domains():
    assert [field_domain(t) for t in ("Zool.", "Physics", "Med.", "Eng. Law", "Lawn Tennis", "Stock Exchange",
                                      "Obs.", "Naut.")] == \
        ["science", "science", "medicine", "law", "general", "finance", "general", "general"]


def test_wordnet_documents(tmp_path):
    licence = "  1 This software and database is being provided\n"
    (tmp_path / "data.noun").write_text(
        licence + '02084071 05 n 03 dog 0 domestic_dog 0 Canis_familiaris 0 000 | a member of the genus Canis; '
                  '"the dog barked all night"  \n', encoding="latin-1")
    (tmp_path / "data.adj").write_text(licence + "00001740 00 a 01 able(a) 0 000 | having the necessary means\n")
    for pos in ("verb", "adv"):
        (tmp_path / f"data.{pos}").write_text(licence)
    docs = list(wordnet_documents(tmp_path, "dictionary/wordnet"))
    assert [d.doc_id for d in docs] == ["noun/02084071", "adj/00001740"]
    assert docs[0].text == 'dog, domestic dog, Canis familiaris, n.\na member of the genus Canis; "the dog barked all night"'
    assert docs[0].meta["lemmas"] == ["dog", "domestic dog", "Canis familiaris"]
    assert docs[1].meta["headword"] == "able"


def test_write_documents_is_byte_deterministic(tmp_path):
    docs = [Document("x/y", f"d{i:02d}", normalise_text(f"text {i}\r\n\n\n\n\nend  \t"), {"k": i}) for i in (3, 1, 2)]
    a = write_documents(tmp_path / "a.jsonl", docs)
    write_documents(tmp_path / "b.jsonl", list(reversed(docs)))
    assert [d.doc_id for d in a] == ["d01", "d02", "d03"]
    assert file_sha256(tmp_path / "a.jsonl") == file_sha256(tmp_path / "b.jsonl") == documents_sha256(docs)
    assert list(read_documents(tmp_path / "a.jsonl", "x/y")) == a
    with pytest.raises(ValueError):
        write_documents(tmp_path / "c.jsonl", docs + [docs[0]])


def test_normalise_text():
    assert normalise_text("\n\n  a\u00a0 \r\nb\x07\r\n\n\n\n\n\tc\u0065\u0301  \n\n") == "  a\nb\n\n\n\tc\u00e9"


def test_html_to_text_drops_navigation():
    html = ('<html><head><title>T</title></head><body><div class="navheader"><a>Prev</a></div>'
            '<div class="sect1"><h2>1.1. Loans</h2><p>A loan is\n  money.</p><ul><li><p>first</p></li></ul>'
            '<pre>  x = 1\n  y = 2</pre></div><div class="navfooter">Next</div></body></html>')
    assert html_to_text(html) == "1.1. Loans\n\nA loan is money.\n\n- first\n\n  x = 1\n  y = 2"


def test_info_nodes(tmp_path):
    raw = ("This is x.info.\n\x1f\nFile: x.info,  Node: Top,  Next: Balance,  Up: (dir)\n\nIntro text.\n"
           "\x1f\nFile: x.info,  Node: Balance,  Prev: Top\n\nThe balance command.\n\x1f\nTag Table:\nNode: Top\x7f1\n")
    (tmp_path / "x.info.gz").write_bytes(gzip.compress(raw.encode(), mtime=0))
    assert info_nodes(tmp_path / "x.info.gz") == [("Top", "\nIntro text.\n"), ("Balance", "\nThe balance command.\n")]


def test_man_redirect():
    assert man_is_redirect('.\\" comment\n.so man3/printf.3\n')
    assert not man_is_redirect(".TH LS 1\n.SH NAME\nls \\- list\n")


def _xdr(obj) -> bytes:
    """Tiny R XDR serializer for the test: list[str] -> STRSXP, list[int] -> INTSXP, dict -> named VECSXP."""
    if isinstance(obj, dict):
        out = struct.pack(">ii", 19 | 1 << 9, len(obj)) + b"".join(_xdr(v) for v in obj.values())
        names = _xdr(list(obj))
        return out + struct.pack(">i", 2 | 1 << 10) + struct.pack(">ii", 1, 9) + struct.pack(">i", 5) + b"names" \
            + names + struct.pack(">i", 254)
    if all(isinstance(v, str) for v in obj):
        body = b"".join(struct.pack(">ii", 0x40009, len(v.encode())) + v.encode() for v in obj)
        return struct.pack(">ii", 16, len(obj)) + body
    return struct.pack(">ii", 13, len(obj)) + struct.pack(f">{len(obj)}i", *obj)


def test_rserialize_lazyload(tmp_path):
    header = b"X\n" + struct.pack(">iii", 2, 0x40201, 0x20300)
    lines = ["EMMA", "", "CHAPTER I", "Emma Woodhouse, handsome, clever, and rich, ", "¿ünïcode?"]
    raw = header + _xdr(lines)
    blob = struct.pack(">I", len(raw)) + zlib.compress(raw)
    (tmp_path / "R.rdb").write_bytes(blob)
    index = header + _xdr({"variables": {"emma": [0, len(blob)]}, "references": {}, "compressed": [1]})
    (tmp_path / "R.rdx").write_bytes(gzip.compress(index, mtime=0))
    assert read_lazyload_strings(tmp_path / "R.rdx", tmp_path / "R.rdb") == {"emma": lines}
    bad = header + struct.pack(">i", 3)                     # a closure: not supported
    (tmp_path / "R.rdb").write_bytes(struct.pack(">I", len(bad)) + zlib.compress(bad))
    with pytest.raises(RDataError):
        read_lazyload_strings(tmp_path / "R.rdx", tmp_path / "R.rdb")


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def _synthetic_pieces():
    return [(f"t/s:{i:02d}", "\n".join(f"Line {j} of document {i}: the ledger balances débits and crédits "
                                       f"({i * j} units)." for j in range(12))) for i in range(8)]


def test_cut_windows_deterministic_exact_and_round_trips(tok):
    a = cut_windows(tok, _synthetic_pieces(), 4, window=96)
    b = cut_windows(tok, _synthetic_pieces(), 4, window=96)
    assert a == b and len(a) == 4
    stream = "\n\n".join(t for _, t in _synthetic_pieces())
    pos = 0
    for w in a:
        assert len(w.tokens) == 96
        assert tok.encode(w.text, add_special_tokens=False).ids == list(w.tokens)
        at = stream.index(w.text, pos)
        assert at >= pos                                  # in order, never overlapping
        pos = at + len(w.text)
        assert w.documents and all(k.startswith("t/s:") for k in w.documents)
    with pytest.raises(SliceError):
        cut_windows(tok, _synthetic_pieces()[:1], 4, window=96)


def test_exclusion_rule():
    sliced = Document("science/gcide", "00000100 Heron", "Heron, n.\nA bird.", {"headword": "Heron", "entry": 100})
    excl = Exclusion.from_reservation(Reservation({"science/judge": ((sliced,),)}))
    assert excl.excludes(sliced)
    assert excl.excludes(Document("dictionary/gcide", "00000100 Heron", "x", {"headword": "Heron", "entry": 100}))
    assert excl.excludes(Document("dictionary/gcide", "00000900 heron", "x", {"headword": "heron", "entry": 900}))
    assert excl.excludes(Document("dictionary/wordnet", "noun/1", "x", {"headword": "egret", "lemmas": ["egret",
                                                                                                       "HERON"]}))
    assert not excl.excludes(Document("dictionary/wordnet", "noun/2", "x", {"headword": "crane", "lemmas": ["crane"]}))
    assert not excl.excludes(Document("english/kjv", "01-Ge/001", "the heron"))


def test_definition_chats_deterministic():
    docs = [Document("dictionary/wordnet", f"noun/{i}", f"w{i}, n.\ngloss {i}", {"headword": f"w{i}", "pos": "n."})
            for i in range(40)]
    convs = list(definition_conversations(docs))
    assert convs == list(definition_conversations(reversed(docs)))
    assert sum(len(m) for m, _ in convs) == 2 * len(docs)
    assert [len(m) for m, _ in convs].count(4) == len(convs) // 8
    assert any(t for _, t in convs) and not all(t for _, t in convs)
    for text, (msgs, thinking) in zip(render_definition_chats(docs), convs):
        assert text.startswith("<｜begin▁of▁sentence｜><｜User｜>") and text.endswith("<｜end▁of▁sentence｜>")
        assert ("<think>" in text) == thinking
        assert msgs[1]["content"] in text


def test_draw_batch_deterministic_and_weighted():
    parts = {"a": np.arange(1000, dtype=np.uint16), "b": np.arange(2000, 2500, dtype=np.uint16),
             "c": np.zeros(300, dtype=np.uint16)}
    ts = TrainingSet(parts, {"a": 0.7, "b": 0.3, "c": 0.0})
    x = ts.draw_batch(5, batch=64, seq_len=16)
    assert x.shape == (64, 17) and np.array_equal(x, ts.draw_batch(5, batch=64, seq_len=16))
    assert not np.array_equal(x, ts.draw_batch(6, batch=64, seq_len=16))
    assert np.all(np.diff(x, axis=1) == 1)              # each row is one contiguous stretch of a part
    assert not (x[:, 0] == 0).all() and (x < 2500).all()
    from_b = (x[:, 0] >= 2000).mean()
    assert 0.1 < from_b < 0.5


def test_pins_sources_and_committed_records_agree():
    for source in SOURCES.values():
        assert set(source.packages) <= set(PINS), source.id
    for pin in PINS.values():
        assert len(pin.sha256) == 64 and pin.kind in ("deb", "wheel")
    manifest = load_manifest(COMMITTED_MANIFEST)
    assert set(manifest.sources) == set(SOURCES)
    for sid, entry in manifest.sources.items():
        assert [(p["name"], p["version"], p["sha256"]) for p in entry["packages"]] == \
            [(p, PINS[p].version, PINS[p].sha256) for p in SOURCES[sid].packages]
        assert entry["documents"] > 0 and len(entry["sha256"]) == 64
    training = json.loads((COMMITTED_MANIFEST.parent / "training_set.json").read_text())
    assert training["tokenizer_sha256"] == tokenizer_sha256(TOKENIZER_DIR / "tokenizer.json")
    assert set(training["parts"]) == set(MIXTURE) and abs(sum(MIXTURE.values()) - 1) < 1e-9
    assert training["total_tokens"] == sum(p["tokens"] for p in training["parts"].values())


def test_cli_registers_subcommands(capsys):
    from ds4lib.tools.cli import main
    for argv in (["corpus", "--help"], ["corpus", "build", "--help"], ["tokenizer", "train", "--help"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 0
    assert main(["tokenizer", "info"]) == 0
    assert "Engram compressed vocab" in capsys.readouterr().out
