"""Synthetic large batches shaped like BatchLLM's first industry workload.

In that workload many prompts (about 7 on average) share one long prefix, a web
document several times longer than each prompt's distinct part, and every
document sits behind one of a few short instruction templates. The templates
make the first level of the prefix tree nearly useless (a handful of short nodes
covering everything), so the prefix DP must enlarge them down to the documents.
Some groups also nest: a subset of a document's prompts shares an extra
sub-prefix, which a one-level grouping can only partly exploit.
"""

from __future__ import annotations

import random


def synthetic_batch(
    num_prefixes: int,
    prompts_per_prefix: int,
    prefix_len: int,
    distinct_len: int,
    seed: int = 0,
    vocab: int = 32000,
) -> list[list[int]]:
    """Prompts (token ids) in a shuffled arrival order that interleaves the groups.

    ``prompts_per_prefix``, ``prefix_len`` and ``distinct_len`` are means: each
    group draws its size within +-2 (at least 2), lengths vary by +-25% (distinct
    parts by +-50%), and about one group in four has a nested sub-prefix an eighth
    of ``distinct_len`` long, shared by part of its prompts.
    """
    if min(num_prefixes, prompts_per_prefix, prefix_len, distinct_len) <= 0 or vocab < 2:
        raise ValueError(
            "num_prefixes, prompts_per_prefix, prefix_len and distinct_len must be "
            f"positive and vocab at least 2; got {num_prefixes}, {prompts_per_prefix}, "
            f"{prefix_len}, {distinct_len}, {vocab}"
        )
    rng = random.Random(seed)
    token_ids = range(vocab)

    def tokens(count: int) -> list[int]:
        return rng.choices(token_ids, k=count)

    def around(mean: int, spread: float) -> int:
        return max(1, rng.randint(round(mean * (1 - spread)), round(mean * (1 + spread))))

    template_len = max(1, prefix_len // 64)
    templates = [tokens(template_len) for _ in range(min(3, num_prefixes))]
    prompts: list[list[int]] = []
    for index in range(num_prefixes):
        template = templates[index % len(templates)]
        document = tokens(max(1, around(prefix_len, 0.25) - template_len))
        shared = template + document
        size = max(2, rng.randint(prompts_per_prefix - 2, prompts_per_prefix + 2))
        nested: set[int] = set()
        sub_prefix: list[int] = []
        if size >= 3 and rng.random() < 0.25:
            nested = set(rng.sample(range(size), rng.randint(2, size - 1)))
            sub_prefix = tokens(around(max(1, distinct_len // 8), 0.25))
        for member in range(size):
            head = shared + sub_prefix if member in nested else shared
            prompts.append(head + tokens(around(distinct_len, 0.5)))
    rng.shuffle(prompts)
    return prompts


def shared_document_batch(num_documents: int, questions_per_document: int, header_len: int, document_len: int,
                          question_len: int, seed: int = 0, vocab: int = 32000) -> list[list[int]]:
    """Questions about shared documents behind one chat header, shuffled: prompt = header (the
    chat template's system turn, shared by all) + document + question (+-50%). Two levels of
    sharing, the header above every document's group."""
    if min(num_documents, questions_per_document, header_len, document_len, question_len) <= 0:
        raise ValueError("every count and length must be positive")
    rng = random.Random(seed)

    def tokens(count: int) -> list[int]:
        return rng.choices(range(vocab), k=count)

    header = tokens(header_len)
    prompts = []
    for _ in range(num_documents):
        document = tokens(document_len)
        for _ in range(questions_per_document):
            n = max(1, rng.randint(round(question_len * 0.5), round(question_len * 1.5)))
            prompts.append(header + document + tokens(n))
    rng.shuffle(prompts)
    return prompts
