"""Chat prompts and the teacher's own answers: the data of ability-transfer distillation (lesson 09).

What the teacher can *do* (answer a question, follow an instruction) lives in its answers to chat prompts, not in plain
text (distill.py), so the student must learn those too. `chat_prompts` builds a few thousand prompts offline from
templates (questions over facts, arithmetic, words, definitions, lists, advice, writing; tasks over paragraphs of
CPython's documentation). `split` holds some out by a hash of the text, always with the prompts lessons 10 and 13
measure on, so "retained ability" is measured on unseen prompts. The answers: recipes/small_model.py `teacher_answers`.
"""

from __future__ import annotations

import hashlib
import random

from minillm.compress.quality import pydoc_text

COUNTRIES = ["France", "Japan", "Brazil", "Canada", "Egypt", "India", "Italy", "Spain", "Germany", "Mexico",
             "Kenya", "Peru", "China", "Russia", "Norway", "Sweden", "Greece", "Turkey", "Argentina", "Chile",
             "Australia", "Nigeria", "Poland", "Portugal", "Ireland", "Thailand", "Vietnam", "Morocco", "Cuba",
             "Austria", "Belgium", "Denmark", "Finland", "Iceland", "Hungary", "Indonesia", "Pakistan", "Colombia",
             "Ghana", "Ethiopia", "Iran", "Iraq", "Israel", "Jamaica", "Nepal", "Switzerland", "Ukraine",
             "the United States", "the United Kingdom", "South Korea", "New Zealand", "South Africa"]
ELEMENTS = ["gold", "silver", "iron", "oxygen", "hydrogen", "carbon", "helium", "sodium", "potassium", "copper",
            "lead", "tin", "zinc", "nitrogen", "calcium", "mercury", "uranium", "neon", "chlorine", "sulfur"]
CONCEPTS = ["photosynthesis", "gravity", "democracy", "inflation", "a black hole", "evolution", "an atom",
            "electricity", "a volcano", "the internet", "a computer", "an algorithm", "machine learning", "a virus",
            "the immune system", "climate change", "a rainbow", "an eclipse", "DNA", "a cell", "friction", "energy",
            "a planet", "a galaxy", "the water cycle", "a noun", "a verb", "a poem", "a metaphor", "a democracy",
            "a budget", "interest rates", "a recipe", "a museum", "a library", "a programming language", "Python",
            "a database", "encryption", "a password", "a battery", "a magnet", "sound", "light", "temperature",
            "a habit", "exercise", "sleep", "nutrition", "a vaccine", "an ecosystem", "a desert", "a glacier",
            "an earthquake", "a hurricane", "the moon", "the sun", "a comet", "a telescope", "a microscope",
            "a calendar", "a leap year", "a fraction", "a prime number", "an equation", "geometry", "history",
            "philosophy", "music", "a symphony", "a novel", "a movie", "a camera", "a bicycle", "an engine"]
WORDS = ["happy", "sad", "big", "small", "fast", "slow", "hot", "cold", "bright", "dark", "easy", "hard", "old",
         "young", "strong", "weak", "rich", "poor", "quiet", "loud", "clean", "dirty", "early", "late", "kind",
         "brave", "calm", "angry", "funny", "smart", "tall", "short", "wide", "narrow", "heavy", "light"]
NOUNS = ["mouse", "child", "tooth", "foot", "person", "woman", "goose", "fish", "sheep", "leaf", "knife", "box",
         "city", "baby", "story", "bus", "potato", "hero", "wolf", "cactus"]
CATEGORIES = ["fruits", "vegetables", "colors", "animals", "birds", "sports", "musical instruments", "planets",
              "countries in Europe", "countries in Asia", "programming languages", "board games", "flowers",
              "trees", "insects", "ocean animals", "kitchen tools", "famous scientists", "famous painters",
              "breakfast foods", "winter activities", "things in a classroom", "types of weather", "shapes",
              "jobs", "hobbies", "farm animals", "desserts", "vehicles", "metals", "languages", "rivers"]
TASKS = ["learn a new language", "sleep better", "save money", "stay focused", "make friends", "bake bread",
         "learn to code", "start running", "write an essay", "keep a plant alive", "reduce stress",
         "prepare for an exam", "cook rice", "plan a trip", "organize my desk", "be more productive",
         "give a good presentation", "learn to swim", "read more books", "drink more water", "wake up early",
         "make a cup of tea", "clean a window", "remember names", "learn the guitar", "write a cover letter"]
TOPICS = ["the ocean", "autumn", "a cat", "the city at night", "friendship", "the mountains", "rain", "coffee",
          "the stars", "a garden", "winter", "a long journey", "the moon", "a dog", "music", "the sea", "a forest",
          "a library", "spring", "the morning", "a river", "a birthday", "home", "snow", "the desert", "a train"]
TEXT_TASKS = ["Summarize this text in one sentence:\n\n{}", "What is the main idea of this text?\n\n{}",
              "Explain this text in simple words:\n\n{}", "List the key points of this text:\n\n{}"]

# lesson 13's cascade questions: held out of every training set, so the cascade measures a student on new prompts
CASCADE_QUESTIONS = [
    "What is the capital of France?", "How many legs does a spider have?", "Who wrote Romeo and Juliet?",
    "What is 2 + 2?", "What is the boiling point of water in Celsius?",
    "What is the largest planet in the solar system?",
    "What language is spoken in Brazil?", "What is the chemical symbol for gold?", "How many days are in a week?",
    "What is the opposite of hot?", "Say hello in Spanish.", "What do bees make?", "Which ocean is the largest?",
    "What is the capital of Japan?", "How many continents are there?", "What gas do plants absorb from the air?",
    "Who painted the Mona Lisa?", "What is the square root of 81?", "Translate 'thank you' into French.",
    "What is the tallest mountain in the world?", "What is H2O commonly called?", "How many hours are in a day?",
    "What is the plural of mouse?", "Which planet is closest to the Sun?", "What is the main ingredient of guacamole?",
    "Is ice cold? Answer yes or no.", "What currency is used in the United Kingdom?", "What color is a ripe banana?",
    "Give me a synonym for happy.", "What is the freezing point of water in Fahrenheit?",
    "Who was the first person to walk on the Moon?", "Complete the proverb: The early bird catches the ...",
]


# lesson 10's open-chat prompts (minillm bench speculative): held out too, so the learned drafter is timed on new text
SPECULATIVE_CHAT = ["Give me three tips for staying healthy.", "Write a short poem about the sea.",
                    "Explain what a hash table is.", "What should I pack for a weekend hiking trip?"]
ALWAYS_HELD_OUT = frozenset(CASCADE_QUESTIONS + SPECULATIVE_CHAT)


def _paragraphs(n: int, rng: random.Random) -> list[str]:
    """n prose paragraphs of pydoc (200-600 characters, not code), drawn without replacement."""
    paras = [p for p in pydoc_text().split("\n\n") if 200 < len(p) < 600 and not p.startswith(" ")]
    return rng.sample(paras, min(n, len(paras)))


def chat_prompts(seed: int = 0) -> list[str]:
    """Every templated prompt (~3,000), de-duplicated, in a fixed order for a seed."""
    rng = random.Random(seed)
    out = []
    for c in COUNTRIES:
        out += [f"What is the capital of {c}?", f"What language is spoken in {c}?", f"What continent is {c} in?",
                f"What currency is used in {c}?", f"Tell me one fact about {c}."]
    out += [f"What is the chemical symbol for {e}?" for e in ELEMENTS]
    out += [f"Is {e} a metal? Answer yes or no." for e in ELEMENTS]
    for c in CONCEPTS:
        out += [f"What is {c}?", f"Explain {c} in one sentence.", f"Explain {c} to a child.",
                f"Give an example of {c}." if c.startswith(("a ", "an ")) else f"Why is {c} important?"]
    for w in WORDS:
        out += [f"Give me a synonym for {w}.", f"What is the opposite of {w}?", f"Use the word '{w}' in a sentence."]
    out += [f"What is the plural of {n}?" for n in NOUNS]
    for cat in CATEGORIES:
        out += [f"Name three {cat}.", f"List five {cat}.", f"What are some {cat}?"]
    for t in TASKS:
        out += [f"How do I {t}?", f"Give me one tip to {t}.", f"What is the first step to {t}?"]
    for t in TOPICS:
        out += [f"Write a short poem about {t}.", f"Write one sentence about {t}.", f"Describe {t} in three words."]
    for _ in range(600):
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        out.append(rng.choice([f"What is {a} + {b}?", f"What is {a} times {b}?", f"What is {a + b} minus {b}?",
                               f"Is {a} an even number?", f"What is {a} plus {b}?"]))
    for i, p in enumerate(_paragraphs(430, rng)):  # two tasks per paragraph
        out += [TEXT_TASKS[i % len(TEXT_TASKS)].format(p), TEXT_TASKS[(i + 1) % len(TEXT_TASKS)].format(p)]
    seen, prompts = set(CASCADE_QUESTIONS), list(CASCADE_QUESTIONS)
    for p in out:
        if p not in seen:
            seen.add(p)
            prompts.append(p)
    return prompts


def is_held_out(prompt: str, share: float = 0.08) -> bool:
    """A prompt is held out by a hash of its text (stable across runs and machines), and always when a lesson
    measures on it (lesson 13's cascade questions, lesson 10's open-chat prompts)."""
    if prompt in ALWAYS_HELD_OUT:
        return True
    h = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:8], "big")
    return h / 2**64 < share


def split(prompts: list[str]) -> tuple[list[str], list[str]]:
    """(train, held_out): held-out prompts are never trained on (tests/test_distill.py checks it)."""
    return [p for p in prompts if not is_held_out(p)], [p for p in prompts if is_held_out(p)]


def chat_ids(tokenizer, prompt: str) -> list[int]:
    """The prompt as the instruct model sees it: one user turn in its chat template, ready for the answer."""
    return tokenizer.encode_chat([{"role": "user", "content": prompt}])
