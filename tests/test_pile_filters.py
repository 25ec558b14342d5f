"""Issue 45 item 2: the filters practitioners use (course_lib.pile.filters, notebook 69e), each against a reference:
C4's line rules line for line against datatrove's C4QualityFilter on the mini-Pile, e-mail and IP masking against
datatrove's PIIFormatter's patterns, phone numbers and GPT-3's decontamination on constructed cases with known
answers, language identification on sentences of known language, and the steps inside datatrove pipelines."""
import re

import pytest

pytest.importorskip("datatrove")
from datatrove.data import Document
from datatrove.pipeline.filters.c4_filters import C4QualityFilter
from datatrove.pipeline.formatters.pii import PIIFormatter, public_ip_validator

from course_lib.pile import mini_pile, read_jsonl_zst
from course_lib.pile.clean import normalize_text, shingle_hashes
from course_lib.pile.filters import (
    C4LineFilter, GPT3Decontamination, LanguageIdFilter, PIIMasker, PII_TOKENS, c4_clean, detect_language,
    gpt3_decontaminate, mask_emails, mask_ips, mask_phone_numbers, mask_pii, word_spans)
from course_lib.pile.quality import Decontaminator


@pytest.fixture(scope="module")
def docs():
    return [r["text"] for p in mini_pile(0.5).values() for r in read_jsonl_zst(p)]


# --- C4 -------------------------------------------------------------------------------------------------------
PAGE = """Welcome to our site!
Home | About | Contact
This site uses cookies to improve your experience.
The river floods every spring, and the farmers plant after it recedes [2].
Please enable JavaScript to view the comments.
They grow rice, beans and maize on the wet fields. The harvest comes in autumn.
Read more...
"A quoted line of four words."
"""


def _datatrove_c4(text):
    doc = Document(text=text, id="0")
    out = C4QualityFilter(min_num_sentences=-1).filter(doc)
    return (doc.text, "") if out is True else (None, out[1])


def test_c4_lines_are_datatrove_c4_quality_filter(docs):
    cases = docs + [PAGE, PAGE + "lorem ipsum dolor sit amet.\n", PAGE + "int f() { return 1; } is code.\n"]
    differ = [i for i, t in enumerate(cases) if c4_clean(t, min_sentences=-1) != _datatrove_c4(t)]
    assert not differ, differ[:5]
    kept = sum(c4_clean(t, min_sentences=-1)[0] is not None for t in docs)
    assert 0 < kept < len(docs)                                   # the rules keep some and drop some


def test_c4_page_rules_and_sentences():
    text, why = c4_clean(PAGE, min_sentences=-1)
    assert text.splitlines() == ["Welcome to our site!",
                                 "The river floods every spring, and the farmers plant after it recedes .",
                                 "They grow rice, beans and maize on the wet fields. The harvest comes in autumn.",
                                 '"A quoted line of four words."']
    assert c4_clean(PAGE) == (text, "")                            # five sentences kept: enough
    assert c4_clean(PAGE, min_sentences=6) == (None, "too_few_sentences")
    assert c4_clean(PAGE + "lorem ipsum dolor sit amet.\n") == (None, "lorem_ipsum")
    doc = Document(text=PAGE, id="p")
    assert C4LineFilter(min_sentences=-1).filter(doc) is True and doc.text == text


# --- PII ------------------------------------------------------------------------------------------------------
EMAILS = ["jane.doe@example.org", "a_b+tag@mail.co.uk", "x@y.io", "first-last@sub.domain.com"]
NOT_EMAILS = ["@handle", "name@", "a@b", "user at example dot com"]
IPS = ["192.168.4.20", "8.8.8.8", "255.255.255.255", "10.0.0.1"]
NOT_IPS = ["999.1.1.1", "1.2.3", "256.1.1.1", "1.2.3.4.5"]


def test_emails_and_ips_match_datatrove_pii_patterns():
    pii = PIIFormatter()
    text = " ".join(f"write to {e}, then" for e in EMAILS + NOT_EMAILS)
    theirs = [m.group() for m in pii.emails_replacer.regex.finditer(text)]
    assert theirs == EMAILS and mask_emails(text) == (pii.emails_replacer.regex.sub(
        PII_TOKENS["email"], text), len(EMAILS))
    text = " ".join(f"host {a} up;" for a in IPS + NOT_IPS)
    theirs = [m.group() for m in pii.ip_replacer.regex.finditer(text)
              if public_ip_validator(m.group(), public_only=False)]
    masked, n = mask_ips(text)
    assert n == len(IPS) and set(theirs) >= set(IPS)
    assert all(a not in masked for a in IPS) and all(a in masked for a in NOT_IPS)


@pytest.mark.parametrize("number", ["(555) 010-0199", "555-010-0199", "555.010.0199", "+1 555 010 0199",
                                    "1-555-010-0199", "5550100199"])
def test_phone_numbers_masked(number):
    assert mask_phone_numbers(f"call {number} today") == (f"call {PII_TOKENS['phone']} today", 1)


@pytest.mark.parametrize("text", ["version 1.2.3", "on 2026-12-06", "id 12345678901234", "pi is 3.14159265"])
def test_not_phone_numbers(text):
    assert mask_phone_numbers(text) == (text, 0)


def test_pii_masker_step_counts():
    note = "mail jane.doe@example.org or 8.8.8.8 or (555) 010-0199 or bob@x.org"
    assert mask_pii(note)[1] == {"email": 2, "ip": 1, "phone": 1}
    step = PIIMasker()
    out = list(step.run([Document(text=note, id="0")]))
    assert out[0].text == mask_pii(note)[0] and step.stats["masked_email"].total == 2


# --- language identification ----------------------------------------------------------------------------------
@pytest.mark.parametrize("lang,text", [
    ("en", "The committee approved the budget after a long debate about the new school."),
    ("de", "Der Ausschuss hat den Haushalt nach einer langen Debatte genehmigt."),
    ("fr", "Le comité a approuvé le budget après un long débat sur la nouvelle école."),
    ("es", "El comité aprobó el presupuesto tras un largo debate sobre la nueva escuela.")])
def test_language_of_known_sentences(lang, text):
    got, p = detect_language(text + "\n" + text)                   # newlines: the classifier reads one line
    assert got == lang and p > 0.65


def test_language_filter_keeps_english_and_records_it():
    f = LanguageIdFilter(["en"])
    en, de = (Document(text="The farmers plant rice after the river floods in spring.", id="e"),
              Document(text="Die Bauern pflanzen Reis, nachdem der Fluss im Frühling über die Ufer tritt.", id="d"))
    assert f.filter(en) is True and en.metadata["language"] == "en"
    assert f.filter(de)[0] is False and de.metadata["language"] == "de"
    with pytest.raises(ValueError, match="threshold must be in"):
        LanguageIdFilter(threshold=1.5)


# --- GPT-3's decontamination ----------------------------------------------------------------------------------
def test_word_spans_read_unit_6s_words(docs):
    for t in docs[:200]:
        spans, words = word_spans(t)
        assert words == normalize_text(t).split()


TEST = ("the quick brown fox jumps over the lazy dog while the farmer counts his sheep in the field near "
        "the river")
FILL = "Farm news of the week covers the weather, the markets and the local fair. "


def test_gpt3_cuts_the_ngram_and_200_characters_each_side():
    decon = Decontaminator([TEST], n=13)
    hit = "Yesterday the quick brown fox jumps over the lazy dog while the farmer counts his sheep today. "
    doc = FILL * 8 + hit + FILL * 8
    pieces = gpt3_decontaminate(doc, decon)
    a = doc.index("the quick brown fox")
    b = doc.index("his sheep") + len("his sheep")                   # the last shared 13-gram ends here
    assert pieces == [doc[:a - 200], doc[b + 200:]]
    assert decon.hits(doc) > 0 and gpt3_decontaminate(FILL * 8, decon) == [FILL * 8]


def test_gpt3_drops_a_document_cut_into_more_than_ten_pieces():
    decon = Decontaminator([TEST], n=13)
    chunk = FILL * 10 + TEST + ". "                               # 750 characters between hits
    assert len(gpt3_decontaminate(chunk * 9 + FILL * 10, decon)) == 10
    assert gpt3_decontaminate(chunk * 10 + FILL * 10, decon) is None
    assert gpt3_decontaminate(TEST, decon) == []                   # nothing of 200 characters is left


def test_gpt3_finds_the_same_hits_as_isin_with_many_eval_texts():
    # the lookup is a binary search in the sorted evaluation hashes (np.isin sorted them every call):
    # a document cut where np.isin finds a shared n-gram, and an empty evaluation set cuts nothing
    import numpy as np
    from course_lib.pile.clean import _ngram_hashes, _word_hashes
    rng = np.random.default_rng(0)
    vocab = [f"w{i}" for i in range(50)]
    evals = [" ".join(rng.choice(vocab, 40)) for _ in range(30)] + [TEST]
    decon = Decontaminator(evals, n=13)
    for doc in [FILL * 4 + TEST + " " + FILL * 4, " ".join(rng.choice(vocab, 400)), FILL * 8]:
        grams = _ngram_hashes(_word_hashes(word_spans(doc)[1]), 13)
        hit = np.isin(grams, decon.grams).any()
        assert (gpt3_decontaminate(doc, decon) != [doc]) == hit
    assert gpt3_decontaminate(FILL * 4 + TEST, Decontaminator([], n=13)) == [FILL * 4 + TEST]


def test_gpt3_step_yields_pieces_with_their_metadata():
    decon = Decontaminator([TEST], n=13)
    docs = [Document(text=FILL * 8 + TEST + ". " + FILL * 8, id="a", metadata={"meta": {"pile_set_name": "X"}}),
            Document(text=FILL * 8, id="b", metadata={"meta": "kept as read"}),
            Document(text=TEST, id="c")]
    step = GPT3Decontamination(decon)
    out = list(step.run(docs))
    assert [d.id for d in out] == ["a/0", "a/1", "b"]
    assert out[0].metadata == {"meta": {"pile_set_name": "X"}} and out[2].metadata == {"meta": "kept as read"}
    assert step.stats["dropped"].total == 1 and step.stats["pieces"].total == 2


# --- in `course pile clean` -----------------------------------------------------------------------------------
ENGLISH = ("The farmers plant rice after the river floods in spring. They sell part of the crop in the town. "
           "Prices rose last year, and the families were glad. The harvest comes in autumn. The fields rest "
           "in winter.")


def test_run_clean_with_language_c4_and_pii(tmp_path):
    from course_lib.pile import run_clean, write_jsonl_zst
    recs = [{"text": ENGLISH + "\nWrite to jane.doe@example.org for details, they said.\nMenu | Home",
             "meta": {"pile_set_name": "Pile-CC", "i": 0}},
            {"text": "Die Bauern pflanzen Reis, nachdem der Fluss im Frühling über die Ufer tritt. " * 3,
             "meta": {"pile_set_name": "Pile-CC", "i": 1}},
            {"text": "Too short to keep.", "meta": {"pile_set_name": "Pile-CC", "i": 2}},
            {"text": ENGLISH.replace("spring", "summer") + "\nCall (555) 010-0199 before noon, please.",
             "meta": {"pile_set_name": "Pile-CC", "note": "kept as read"}}]
    (tmp_path / "in").mkdir()
    write_jsonl_zst(tmp_path / "in" / "00.jsonl.zst", recs)
    rep = run_clean(tmp_path / "in", tmp_path / "out", dedup=None, filters=("language", "c4", "pii"))
    assert {k: v["documents"] for k, v in rep.removed.items()} == {"language": 1, "c4": 1}
    out = [r for f in sorted((tmp_path / "out").glob("*.jsonl.zst")) for r in read_jsonl_zst(f)]
    want = [mask_pii(c4_clean(r["text"])[0])[0] for r in (recs[0], recs[3])]
    assert [r["text"] for r in out] == want and "|||EMAIL_ADDRESS|||" in want[0]
    assert "Menu | Home" not in want[0] and "|||PHONE_NUMBER|||" in want[1]
    for r, src in zip(out, (recs[0], recs[3])):     # meta as read, plus the language ID (as FineWeb's)
        assert r["meta"].pop("language") == "en" and r["meta"].pop("language_score") >= 0.65
        assert r["meta"] == src["meta"]
    assert rep.balanced and rep.edited["c4"]["documents"] == 1 and rep.edited["pii"]["documents"] == 2
