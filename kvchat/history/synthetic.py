"""Synthetic conversations with planted facts: topics of small talk, one made-up fact in each, and a
question per fact. Deterministic for a seed; used by the demo, the tests and planted-fact recall."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

SPEAKERS = ("Maya", "Tom")

# topic -> (filler lines, fact template, question, answer choices)
_TOPICS: dict[str, tuple[tuple[str, ...], str, str, tuple[str, ...]]] = {
    "pets": (
        (
            "The puppy chewed another shoe this morning.",
            "We walk to the park twice a day now.",
            "The vet said the vaccinations are all up to date.",
            "Training treats work better than anything else.",
            "The cat still hides whenever the puppy barks.",
            "I bought a new leash with a reflective strip.",
            "Grooming takes forever with all that fur.",
            "The neighbours love playing fetch with the puppy.",
        ),
        "By the way, Maya's dog is called {answer}.",
        "What is the name of Maya's dog?",
        ("Biscuit", "Pickles", "Waffles", "Noodle", "Juniper", "Pepperoni"),
    ),
    "travel": (
        (
            "Packing light is harder than it sounds.",
            "The hotel near the old town had great reviews.",
            "I always forget my phone charger when I travel.",
            "The train ride along the coast was beautiful.",
            "We should book the museum tickets in advance.",
            "Street food there is cheap and delicious.",
            "The weather forecast says sunny all week.",
            "I need to renew my passport before the trip.",
        ),
        "Tom's flight to Lisbon leaves from gate {answer}.",
        "Which gate does Tom's flight to Lisbon leave from?",
        ("B17", "C42", "A9", "D23", "E31", "F8"),
    ),
    "cooking": (
        (
            "I tried baking sourdough again this weekend.",
            "The soup needs to simmer for at least an hour.",
            "Fresh herbs make such a difference in salads.",
            "My oven runs a little hot, so I lower the temperature.",
            "We made dumplings from scratch last night.",
            "Cast iron pans are worth the extra care.",
            "I burned the garlic, so I had to start over.",
            "The farmers market had amazing tomatoes.",
        ),
        "The secret ingredient in Maya's grandmother's soup is {answer}.",
        "What is the secret ingredient in Maya's grandmother's soup?",
        ("smoked paprika", "star anise", "lemongrass", "fennel seed", "saffron", "juniper berries"),
    ),
    "work": (
        (
            "The quarterly review went better than expected.",
            "Our team moved to a new office floor.",
            "Meetings took up most of my Tuesday.",
            "The new manager wants weekly status reports.",
            "I finally cleared my inbox before the weekend.",
            "The deadline for the launch moved to next month.",
            "We hired two new engineers this week.",
            "The client asked for a few more changes.",
        ),
        "Tom's project at work has the code name {answer}.",
        "What is the code name of Tom's project at work?",
        ("Bluefin", "Tangerine", "Kestrel", "Moonstone", "Driftwood", "Quasar"),
    ),
    "music": (
        (
            "The concert in the park was packed.",
            "I have been learning a new song on the guitar.",
            "Our choir rehearses every Thursday evening.",
            "Vinyl records sound warmer to me.",
            "The band played their old hits at the end.",
            "I keep humming that melody all day.",
            "My neighbour practises the drums at night.",
            "Jazz is perfect for rainy afternoons.",
        ),
        "Maya practises the violin for {answer} minutes every morning.",
        "For how many minutes does Maya practise the violin every morning?",
        ("25", "40", "35", "50", "45", "55"),
    ),
    "garden": (
        (
            "The roses finally started blooming.",
            "Snails keep eating the lettuce.",
            "I built a small compost bin in the corner.",
            "Watering early in the morning works best.",
            "The apple tree needs pruning this autumn.",
            "Sunflowers grew taller than the fence.",
            "I planted herbs along the kitchen window.",
            "The soil here is mostly clay.",
        ),
        "Tom planted {answer} tomato plants this spring.",
        "How many tomato plants did Tom plant this spring?",
        ("12", "17", "9", "23", "14", "31"),
    ),
}

TOPICS = tuple(_TOPICS)


@dataclass(frozen=True)
class PlantedFact:
    topic: str
    question: str
    answer: str
    turn: int  # index of the turn that states the fact


def planted_conversation(
    seed: int = 0, topics: int = 4, turns_per_topic: int = 24
) -> tuple[list[dict[str, str]], list[PlantedFact]]:
    """Messages (`{"role": speaker, "content": text}`) over `topics` topics, one planted fact each."""
    if not 1 <= topics <= len(_TOPICS):
        raise ValueError(f"topics must be in 1..{len(_TOPICS)}")
    rng = random.Random(seed)
    chosen = rng.sample(TOPICS, topics)
    messages: list[dict[str, str]] = []
    facts: list[PlantedFact] = []
    for topic in chosen:
        filler, template, question, answers = _TOPICS[topic]
        answer = rng.choice(answers)
        fact_at = rng.randrange(turns_per_topic // 4, 3 * turns_per_topic // 4)
        for i in range(turns_per_topic):
            speaker = SPEAKERS[len(messages) % 2]
            if i == fact_at:
                text = template.format(answer=answer)
                facts.append(PlantedFact(topic, question, answer, len(messages)))
            else:
                text = rng.choice(filler)
            messages.append({"role": speaker, "content": text})
    return messages, facts


EXPORT_STYLES = ("openai", "transcript", "whatsapp")
_NAME_PAIRS = (("Maya", "Tom"), ("Dana", "Sam"), ("Priya", "Jonas"), ("Lucia", "Omar"), ("Keiko", "Ben"))


def planted_export(seed: int, style: str, topics: int = 4, turns_per_topic: int = 24) -> tuple[str, list[PlantedFact]]:
    """A planted-fact history as a file's text, made like an export users bring: `openai` (a JSON list of user and
    assistant messages), `transcript` ("[2023-05-08 13:56] Name: text" lines) or `whatsapp` ("08/05/2023, 13:56 -
    Name: text" after the app's notice). The speakers' names vary with `seed` (facts and questions name them)."""
    if style not in EXPORT_STYLES:
        raise ValueError(f"style must be one of {', '.join(EXPORT_STYLES)}")
    messages, facts = planted_conversation(seed, topics, turns_per_topic)
    names = _NAME_PAIRS[seed % len(_NAME_PAIRS)]

    def named(text: str) -> str:
        return text.replace(SPEAKERS[0], "\0").replace(SPEAKERS[1], names[1]).replace("\0", names[0])

    facts = [PlantedFact(f.topic, named(f.question), f.answer, f.turn) for f in facts]
    if style == "openai":
        roles = {SPEAKERS[0]: "user", SPEAKERS[1]: "assistant"}
        return json.dumps([{"role": roles[m["role"]], "content": named(m["content"])} for m in messages]), facts
    lines = ["08/05/2023, 08:59 - Messages and calls are end-to-end encrypted."] if style == "whatsapp" else []
    for i, m in enumerate(messages):
        day, minute = 8 + i // 60, 9 * 60 + i % 60 * 3
        stamp = (f"[2023-05-{day:02d} {minute // 60:02d}:{minute % 60:02d}]" if style == "transcript"
                 else f"{day:02d}/05/2023, {minute // 60:02d}:{minute % 60:02d} -")  # fmt: skip
        lines.append(f"{stamp} {named(m['role'])}: {named(m['content'])}")
    return "\n".join(lines) + "\n", facts


def recalled(answer: str, fact: PlantedFact) -> bool:
    """Planted-fact recall: the answer contains the fact (case-insensitive)."""
    return fact.answer.lower() in answer.lower()


# Questions about another history (a trip to Japan being planned), none of which a planted-fact conversation can
# answer: what an off-topic question looks like (benchmarks/receipts.py measures the off-topic threshold on them).
OFF_TOPIC_QUESTIONS = (
    "What is the confirmation number of the Tokyo hotel?",
    "Which day do we take the shinkansen to Kyoto?",
    "How much did the Japan Rail Pass cost?",
    "What time does the ryokan in Hakone serve dinner?",
    "Which temple did Aiko want to visit first?",
    "Where do we pick up the pocket wifi?",
    "What is the name of the sushi restaurant in Ginza?",
    "How many nights are we staying in Osaka?",
    "Who is bringing the yen from the exchange office?",
    "Which terminal does the flight to Narita arrive at?",
    "What did Ken say about the cherry blossom forecast?",
    "When does the teamLab exhibition close on Fridays?",
    "Which suitcase has the umbrellas in it?",
    "What is the address of the Airbnb in Shibuya?",
    "How do we get from Kansai airport to Namba?",
    "Did Aiko book the tea ceremony for Tuesday?",
    "What souvenir did Ken promise his sister?",
    "How early do we need to queue for the ramen museum?",
    "Which onsen allows tattoos?",
    "What was the reference for the bullet train seat reservation?",
)
