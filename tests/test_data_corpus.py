"""The built-in English -> French corpus: seeds, determinism, disjoint splits, the grammar."""

import random

from transformer_jax.data import translation_corpus as tc


def test_seed_pairs_present_and_splits_disjoint():
    splits = tc.generate_splits(2000, 200, 200, seed=0)
    assert {k: len(v) for k, v in splits.items()} == {"train": 2000, "validation": 200,
                                                      "test": 200}
    for pair in tc.SEED_PAIRS:
        assert pair in splits["train"]
    english = [{en for en, _ in v} for v in splits.values()]
    assert sum(len(s) for s in english) == 2400  # unique within and across splits
    assert not (english[0] & english[1] or english[0] & english[2] or english[1] & english[2])


def test_deterministic_for_a_seed():
    assert tc.generate_splits(300, 30, 30, seed=3) == tc.generate_splits(300, 30, 30, seed=3)
    assert tc.generate_splits(300, 30, 30, seed=3) != tc.generate_splits(300, 30, 30, seed=4)


def test_one_translation_per_sentence_and_modest_length():
    g, rng, seen = tc.Grammar(), random.Random(0), {}
    for _ in range(20000):
        en, fr = g.sample(rng)
        assert seen.setdefault(en, fr) == fr, en
        assert len(en.split()) <= 20 and len(fr.split()) <= 24
    assert len(seen) > 15000  # plenty of distinct sentences


def _sample_many(n=20000):
    g, rng = tc.Grammar(), random.Random(1)
    return dict(g.sample(rng) for _ in range(n))


PAIRS = _sample_many()


def _any(pred):
    return any(pred(en, fr) for en, fr in PAIRS.items())


def test_phenomena_are_present():
    # adjective after the noun, and before it with the special forms before a vowel
    assert _any(lambda en, fr: "the cold coffee" in en and "le café froid" in fr)
    assert _any(lambda en, fr: " old " in f" {en} " and ("vieil " in fr))
    assert _any(lambda en, fr: "beautiful" in en and ("bel " in fr))
    # agreement: feminine and plural adjectives
    assert _any(lambda en, fr: "she is tired" in en and "elle est fatiguée" in fr)
    assert _any(lambda en, fr: "heureuses" in fr)
    # elision and contraction
    assert _any(lambda en, fr: fr.startswith("j'"))
    assert _any(lambda en, fr: " n'" in fr)
    assert _any(lambda en, fr: "près du " in fr)
    assert _any(lambda en, fr: " cet " in f" {fr} ")
    # tenses: passé composé with être and agreement, future, imparfait
    assert _any(lambda en, fr: "elle est arrivée" in fr)
    assert _any(lambda en, fr: "will drink" in en and "boir" in fr)
    assert _any(lambda en, fr: "was eating" in en and "mangeait" in fr)
    # negation with "de", generic plural after verbs of liking, partitive
    assert _any(lambda en, fr: "did not drink" in en and "pas bu de " in fr)
    assert _any(lambda en, fr: en.startswith("I love ") and fr.startswith("j'aime les "))
    assert _any(lambda en, fr: " du " in f" {fr} " or " de la " in fr)
    # possessives follow the noun's gender, mon before a vowel
    assert _any(lambda en, fr: "my school" in en and "mon école" in fr)


def _every(phrase, pred, at_least):
    """pred holds for every pair whose English has `phrase` as whole words (and there are some)."""
    hits = [(en, fr) for en, fr in PAIRS.items() if f" {phrase} " in f" {en} "]
    assert len(hits) >= at_least, (phrase, len(hits))
    wrong = [(en, fr) for en, fr in hits if not pred(fr)]
    assert not wrong, wrong[:3]


def test_rules_hold_in_every_sentence_that_needs_them():
    """Not only somewhere in the corpus: a rule right once and wrong elsewhere fails here."""
    _every("did not", lambda fr: (" ne " in f" {fr} " or " n'" in f" {fr}") and " pas " in f" {fr} ", 500)
    _every("was eating", lambda fr: "mange" in fr, 20)
    _every("will drink", lambda fr: "boir" in fr, 20)
    _every("my school", lambda fr: "mon école" in fr, 10)  # mon before a vowel, not ma
    _every("the cold coffee", lambda fr: "café froid" in fr, 3)  # the adjective after the noun


def test_etre_participle_agrees_with_the_subject_in_gender_and_number():
    arrive = next(v for v in tc._VERBS if v.en[0] == "arrive")
    expected = {(0, "m"): ("suis", "arrivé"), (2, "f"): ("est", "arrivée"),
                (3, "m"): ("sommes", "arrivés"), (4, "m"): ("sont", "arrivés"),
                (4, "f"): ("sont", "arrivées")}
    for (person, gender), (aux, participle) in expected.items():
        assert tc._french_verb(arrive, tc.PAST, person, gender) == ([aux], participle)
    _every("we arrived", lambda fr: "nous sommes arrivés" in fr, 3)


NOUNS = {n.en: n for n in tc._nouns()}
ADJECTIVES = {a.en: a for a in tc._ADJECTIVES}


def _np(noun, plural, determiner, kind, adjective=None):
    return tc.NounPhrase(NOUNS[noun], plural, determiner, kind,
                         ADJECTIVES[adjective] if adjective else None)


def test_negation_turns_indefinites_and_partitives_into_de():
    """pas de café / pas d'eau / pas de chats / pas de chat; definites stay (pas le café)."""
    cases = [(_np("coffee", False, "", "bare"), "du café", "de café"),
             (_np("water", False, "", "bare"), "de l'eau", "d'eau"),
             (_np("soup", False, "", "bare"), "de la soupe", "de soupe"),
             (_np("cat", True, "", "bare"), "des chats", "de chats"),
             (_np("cat", False, "a", "indef"), "un chat", "de chat"),
             (_np("coffee", False, "the", "def"), "le café", "le café")]
    for phrase, plain, negated in cases:
        assert (phrase.french(), phrase.french(negated=True)) == (plain, negated), phrase


def test_english_article_is_an_before_the_vowel_of_the_next_word():
    assert _np("cat", False, "a", "indef", "old").english() == "an old cat"
    assert _np("apple", False, "a", "indef", "big").english() == "a big apple"
    assert _np("umbrella", False, "a", "indef").english() == "an umbrella"
