"""The query sets the suites run: chat questions written for this benchmark, as token ids.

Relay queries are short chat prompts chosen so that greedy answers range from a few tokens
to the 200-token cap: that spread is what re-batching exploits (a static batch runs until its
longest member ends). Mixed queries follow BATON Table 1's three shapes.
"""
from __future__ import annotations

from dataclasses import dataclass

# Short input; the answers are either one line (a fact, a greeting, a translation) or a full
# page (a story, a guide, an essay), as chat traffic is. Each question is followed by one of the
# other kind, so every static batch holds both: the spread BATON's re-batching exploits (a static
# batch runs until its longest member ends). With SmolLM2-135M-Instruct, greedy, the one-line
# answers take 7 to 14 tokens and the page answers reach the 200-token cap.
RELAY_QUESTIONS = [
    "What is the capital of Japan?",
    "Write a short story about a dragon who learns to bake bread.",
    "Name three primary colors.",
    "Explain how a refrigerator keeps food cold.",
    "What is 15 plus 27?",
    "Write a poem about autumn leaves falling in a quiet park.",
    "What is the capital of France?",
    "Give me a step-by-step recipe for pancakes.",
    "Translate 'good morning' into Spanish.",
    "Describe the water cycle in detail.",
    "What is 2 plus 2?",
    "Write a letter to a friend inviting them to a picnic.",
    "Answer with one word: what color is grass?",
    "Explain the difference between weather and climate.",
    "How many days are in a week?",
    "List ten tips for staying productive while working from home.",
    "Translate 'thank you' into French.",
    "Write a product description for a solar-powered backpack.",
    "What is the capital of Italy?",
    "Explain why the moon has phases.",
    "How many continents are there?",
    "Tell me a bedtime story about a sleepy owl.",
    "What is the plural of 'mouse'?",
    "Write an essay about the importance of reading books.",
    "What is the capital of Canada?",
    "Describe how to plant a tree.",
    "What is the capital of Germany?",
    "Explain how the internet works to a ten-year-old.",
    "What is the capital of Egypt?",
    "Write a short story about a robot who wants to become a gardener.",
]

# Mixed shapes (BATON Table 1): a long document to condense, a short request for a long text,
# and short questions with short answers.
_DOCUMENT_TOPICS = ["the history of the printing press", "how bees make honey", "the causes of ocean tides",
                    "the invention of the telephone", "how volcanoes form", "the life cycle of stars"]
_LONG_OUTPUT_REQUESTS = [
    "Write a long, detailed story about a lighthouse keeper and a storm.",
    "Write a detailed guide to starting a vegetable garden, with many steps.",
    "Write a long essay about the history of bicycles.",
    "Describe, in great detail, a day in the life of a medieval blacksmith.",
    "Write a long letter from a sailor to his family describing his voyage.",
    "Explain in depth how computers store and process information.",
]
_SENTENCES = [
    "Historians describe the early period as one of slow change and careful observation.",
    "Many people contributed small improvements that together changed everyday life.",
    "Scientists later measured the effects precisely and published detailed reports.",
    "The process depends on temperature, pressure and the materials involved.",
    "Local communities adapted the idea to their own needs and traditions.",
    "Records from that time are incomplete, but several accounts agree on the main events.",
    "Over the following decades the practice spread across many countries.",
    "Critics at first doubted the claims, yet the evidence kept growing.",
]


@dataclass(frozen=True)
class Query:
    kind: str  # "short-short", "long-short", "short-long"
    messages: tuple[tuple[str, str], ...]
    max_tokens: int

    def chat(self) -> list[dict]:
        return [{"role": role, "content": content} for role, content in self.messages]


def relay_queries(count: int, max_tokens: int) -> list[Query]:
    if not 1 <= count <= len(RELAY_QUESTIONS):
        raise ValueError(f"relay has {len(RELAY_QUESTIONS)} queries; ask for 1..{len(RELAY_QUESTIONS)} (got {count})")
    return [Query("short", (("user", q),), max_tokens) for q in RELAY_QUESTIONS[:count]]


def _document(topic: str, sentences: int, salt: int) -> str:
    body = " ".join(_SENTENCES[(salt + i * 3) % len(_SENTENCES)] for i in range(sentences))
    return f"The following text is about {topic}. {body}"


def mixed_queries(count: int, long_input_sentences: int, short_max: int, long_max: int) -> list[Query]:
    """count queries in the ratio long-short : short-long : short-short = 1 : 1 : 2, interleaved."""
    if count < 4 or count % 4:
        raise ValueError(f"mixed needs a multiple of 4 queries (1:1:2 ratio); got {count}")
    queries = []
    for i in range(count // 4):
        topic = _DOCUMENT_TOPICS[i % len(_DOCUMENT_TOPICS)]
        doc = _document(topic, long_input_sentences, salt=i)
        queries.append(Query("long-short", (("user", f"{doc}\n\nIn one sentence, what is this text about?"),),
                             short_max))
        queries.append(Query("short-short", (("user", RELAY_QUESTIONS[(4 * i) % len(RELAY_QUESTIONS)]),), short_max))
        queries.append(Query("short-long", (("user", _LONG_OUTPUT_REQUESTS[i % len(_LONG_OUTPUT_REQUESTS)]),),
                             long_max))
        queries.append(Query("short-short", (("user", RELAY_QUESTIONS[(4 * i + 2) % len(RELAY_QUESTIONS)]),),
                             short_max))
    return queries
