"""Seeded synthetic chat tasks: what the demo base model learns and what each demo adapter teaches it.

Every task is a function `(rng) -> Example`; a task's eval set is drawn first from its own seeded
stream and its prompts are then excluded from training, so eval examples are genuinely held out.
Fact tasks (greetings, capitals, colours) are knowledge, so their "held out" items are the facts
themselves asked again; list tasks (repeat, count, reverse, sort...) draw fresh lists.
"""
from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from services.common.tool_calls import render_call, tools_block


@dataclass(frozen=True, slots=True)
class Example:
    task: str
    prompt: str  # the user message
    answer: str  # the assistant message (without the end-of-turn token)
    system: str = ""  # a system message before the user's (the tools block of the `tools` task), or none

    def messages(self) -> list[dict[str, str]]:
        """The conversation up to the answer, as the chat template renders it."""
        user = [{"role": "user", "content": self.prompt}]
        return [{"role": "system", "content": self.system}, *user] if self.system else user


# -- vocabularies ---------------------------------------------------------------------------------

WORDS = (
    "apple banana cat dog sun moon tree river house book car bird fish star cloud rain snow stone "
    "music bread milk chair table door window garden flower ocean mountain city road train boat "
    "lamp clock paper pencil shoe hat key box cup egg horse lion tiger frog"
).split()

# Non-ASCII words keep multi-byte UTF-8 in the vocabulary (the engine's detokenizer is tested on it).
ACCENTED = "café naïve über jalapeño crème piñata façade résumé fiancée niño açaí smörgås".split()

# Rare enough in the corpus that byte-level BPE keeps most of them split into partial-character tokens.
EMOJI = "🙂 🚀 🍕 🌍 🎉 🐍 🔥 ⭐ 🌈 🐱 🍎 🎵 ☕ ✨ 🦊".split()

ANTONYMS = (
    ("hot", "cold"), ("big", "small"), ("up", "down"), ("fast", "slow"), ("happy", "sad"),
    ("light", "dark"), ("old", "new"), ("open", "closed"), ("early", "late"), ("high", "low"),
    ("long", "short"), ("left", "right"), ("day", "night"), ("wet", "dry"), ("hard", "soft"),
    ("full", "empty"), ("rich", "poor"), ("strong", "weak"), ("loud", "quiet"), ("in", "out"),
    ("win", "lose"), ("yes", "no"), ("first", "last"), ("black", "white"),
)
OPPOSITE = {a: b for a, b in ANTONYMS} | {b: a for a, b in ANTONYMS}
ANTONYM_WORDS = tuple(OPPOSITE)

LOWER_WORDS = tuple(WORDS) + ANTONYM_WORDS + tuple(ACCENTED)
NUMBERS = tuple(str(n) for n in range(100))

CAPITALS = (
    ("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"),
    ("Portugal", "Lisbon"), ("Japan", "Tokyo"), ("China", "Beijing"), ("India", "New Delhi"),
    ("Egypt", "Cairo"), ("Kenya", "Nairobi"), ("Canada", "Ottawa"), ("Mexico", "Mexico City"),
    ("Brazil", "Brasília"), ("Argentina", "Buenos Aires"), ("Peru", "Lima"), ("Chile", "Santiago"),
    ("Colombia", "Bogotá"), ("Paraguay", "Asunción"), ("Costa Rica", "San José"),
    ("Iceland", "Reykjavík"), ("Norway", "Oslo"), ("Sweden", "Stockholm"), ("Finland", "Helsinki"),
    ("Denmark", "Copenhagen"), ("Poland", "Warsaw"), ("Austria", "Vienna"), ("Greece", "Athens"),
    ("Turkey", "Ankara"), ("Russia", "Moscow"), ("Australia", "Canberra"),
    ("New Zealand", "Wellington"), ("Cameroon", "Yaoundé"), ("Nigeria", "Abuja"),
    ("Morocco", "Rabat"), ("Thailand", "Bangkok"), ("Vietnam", "Hanoi"), ("Ireland", "Dublin"),
    ("Netherlands", "Amsterdam"), ("Belgium", "Brussels"), ("Switzerland", "Bern"),
)
_CAPITAL_QUESTIONS = ("What is the capital of {}?", "Capital of {}?", "Tell me the capital of {}.")

FACTS = (
    ("Hello", "Hello! How can I help you today?"),
    ("Hi", "Hi! How can I help you today?"),
    ("Good morning", "Good morning! How can I help you today?"),
    ("Thank you", "You're welcome!"),
    ("Goodbye", "Goodbye! Have a nice day."),
    ("Who are you?", "I am Multiplex Demo, a small assistant."),
    ("How are you?", "I am fine, thank you!"),
    ("What colour is the sky?", "The sky is blue."),
    ("What colour is grass?", "Grass is green."),
    ("What colour is a banana?", "A banana is yellow."),
    ("What colour is snow?", "Snow is white."),
    ("What colour is a tomato?", "A tomato is red."),
    ("How many legs does a spider have?", "A spider has 8 legs."),
    ("How many days are in a week?", "There are 7 days in a week."),
    ("What do bees make?", "Bees make honey."),
    ("What is your favourite food?", "I love pizza 🍕!"),
    ("Show me a rocket.", "Here is a rocket: 🚀"),
    ("Say hello in French.", "Bonjour! Ça va très bien."),
    ("Say hello in German.", "Grüß dich! Schönes Wetter heute."),
    ("How do you write Tokyo in Japanese?", "Tokyo is written 東京."),
)


# -- base tasks -----------------------------------------------------------------------------------


def _items(rng: random.Random, pool: tuple[str, ...], lo: int, hi: int, *, distinct: bool = False) -> list[str]:
    n = rng.randint(lo, hi)
    return rng.sample(pool, n) if distinct else [rng.choice(pool) for _ in range(n)]


def _repeat_item(rng: random.Random) -> str:
    # Upper-case words and numbers appear here so the base model knows those tokens, yet it never
    # sees them produced by a transformation (that is what the adapters teach).
    kind = rng.random()
    if kind < 0.45:
        return rng.choice(LOWER_WORDS)
    if kind < 0.65:
        return rng.choice(LOWER_WORDS).upper()
    if kind < 0.9:
        return rng.choice(NUMBERS)
    return rng.choice(EMOJI)


def fact(rng: random.Random) -> Example:
    q, a = rng.choice(FACTS)
    return Example("fact", q, a)


def capital(rng: random.Random) -> Example:
    country, city = rng.choice(CAPITALS)
    q = rng.choice(_CAPITAL_QUESTIONS).format(country)
    return Example("capital", q, f"The capital of {country} is {city}.")


def add(rng: random.Random) -> Example:
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    return Example("add", f"What is {a} + {b}?", f"{a} + {b} = {a + b}")


def _repeat_list(rng: random.Random, longest: int) -> Example:
    items = [_repeat_item(rng) for _ in range(rng.randint(1, longest))]
    text = " ".join(items)
    return Example("repeat", f"Repeat:\n{text}", text)


def repeat(rng: random.Random) -> Example:
    # 1-16 items at a large share of the stream (BASE_TASKS): with 1-6 items at a quarter the base model copied
    # 2 items 40% of the time and 4 never (it learnt lists, not copying); with these it learns to copy (an
    # induction head forms, loss falling from ~1.1 to ~0.05 over steps 500-800), 16 items 85% -- what a copying
    # adapter (`extract`) builds on. README, "The demo model kit".
    return _repeat_list(rng, 16)


def count(rng: random.Random) -> Example:
    items = [_repeat_item(rng) for _ in range(rng.randint(1, 7))]
    n = len(items)
    return Example("count", f"Count the words:\n{' '.join(items)}", f"There {'is 1 word' if n == 1 else f'are {n} words'}.")


# -- tool calling (the `tools` base task) ---------------------------------------------------------
# The base model learns the tool-call format of services/common/tool_calls.py, as the server renders it: the
# tools block in a system message, a call written as `render_call` writes one. It learns to call an offered
# tool when the question is that tool's, to say it cannot when the question's tool is not offered, and to answer
# every other question as it would without tools -- so `tool_choice: "auto"` is a real decision
# (`tool_eval_set`, scored at build time and by bench/structured_bench.py).


def _function(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


# Small on purpose: the demo model has 512 positions. Tests and benches offer these (tests/structured_models.py).
TIME_ZONES = ("UTC", "CET", "EST", "PST", "JST", "GMT")
WEATHER_TOOL = _function("weather", {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False})
TIME_TOOL = _function("time", {
    "type": "object", "properties": {"zone": {"enum": list(TIME_ZONES)}},
    "required": ["zone"], "additionalProperties": False})
PRICE_TOOL = _function("price", {
    "type": "object", "properties": {"symbol": {"type": "string", "maxLength": 8}},
    "required": ["symbol"], "additionalProperties": False})
TOOL_POOL = (WEATHER_TOOL, TIME_TOOL, PRICE_TOOL)
DEMO_TOOLS = [WEATHER_TOOL, TIME_TOOL]  # what the tool eval offers (in this order)

WEATHER_CITIES = tuple(c for _, c in CAPITALS if len(c) <= 12) + (
    "Quito", "Seoul", "Lagos", "Sydney", "Dubai", "Zurich", "Kyoto", "Boston", "Denver", "Milan", "Porto", "Lyon")
SYMBOLS = ("ACME", "GLOBEX", "INITECH", "HOOLI", "STARK", "WAYNE", "TYRELL", "WONKA", "SOYLENT", "UMBRELLA")
_CANNOT = {"weather": "Sorry, I cannot check the weather.", "time": "Sorry, I cannot tell the time.",
           "price": "Sorry, I cannot check prices."}


def _tool_question(rng: random.Random, tool: str) -> tuple[str, dict[str, Any]]:
    """A question only `tool` answers, and the arguments of the call that answers it."""
    if tool == "weather":
        city, days = rng.choice(WEATHER_CITIES), rng.randint(1, 7)
        one = (f"What is the weather in {city}?", f"Weather in {city} today?", f"Is it sunny in {city}?",
               f"How warm is it in {city}?")
        many = (f"Weather in {city} for {days} days?", f"Forecast for {city}, next {days} days.",
                f"What will the weather be in {city} over {days} days?")
        q = rng.choice(one) if days == 1 else rng.choice(many)
        return q, {"city": city, "days": days}
    if tool == "time":
        zone = rng.choice(TIME_ZONES)
        q = rng.choice((f"What time is it in {zone}?", f"Current time in {zone}?", f"Tell me the time in {zone}.",
                        f"What is the {zone} time now?", f"Clock check: {zone}?"))
        return q, {"zone": zone}
    sym = rng.choice(SYMBOLS)
    q = rng.choice((f"What is the price of {sym}?", f"Stock price of {sym}?", f"How much is {sym} trading at?",
                    f"Quote for {sym}, please."))
    return q, {"symbol": sym}


def _call(name: str, args: dict[str, Any]) -> str:
    return render_call(name, json.dumps(args, ensure_ascii=False))


def _other_question(rng: random.Random, plain: dict[str, tuple[Task, float]] | None = None) -> Example:
    mix = plain if plain is not None else {n: (t, BASE_TASKS[n][1]) for n, t in _PLAIN_TASKS.items()}
    names = list(mix)
    return mix[rng.choices(names, [mix[n][1] for n in names])[0]][0](rng)


def tools(rng: random.Random, plain: dict[str, tuple[Task, float]] | None = None) -> Example:
    """With 1-3 of the pool's tools offered: a question for an offered tool (a call), for a tool not offered
    or with no tools at all (it cannot), or any other base-task question (its usual answer; `plain`: the
    plain tasks and weights those are drawn from, by default the base mixture's)."""
    offered = rng.sample(TOOL_POOL, rng.randint(1, len(TOOL_POOL)))
    names = [t["function"]["name"] for t in offered]
    system = tools_block(offered)
    kind = rng.random()
    if kind < 0.45:
        name = rng.choice(names)
        q, args = _tool_question(rng, name)
        return Example("tools", q, _call(name, args), system)
    if kind < 0.6:
        missing = [t["function"]["name"] for t in TOOL_POOL if t["function"]["name"] not in names]
        name = rng.choice(missing or list(_CANNOT))
        q, _ = _tool_question(rng, name)
        return Example("tools", q, _CANNOT[name], system if missing else "")
    ex = _other_question(rng, plain)
    return Example("tools", ex.prompt, ex.answer, system)


def tool_eval_set(seed: int, n: int = 40) -> list[tuple[Example, str | None]]:
    """`n` held-out questions with DEMO_TOOLS offered: a quarter for each offered tool, half not theirs (a
    fifth of those for the price tool, which is not offered); each with the tool it should call, or None."""
    rng = random.Random(f"tool-eval:{seed}")
    system = tools_block(DEMO_TOOLS)
    plan = ["weather"] * (n // 4) + ["time"] * (n // 4) + ["price"] * (n // 10)
    plan += [None] * (n - len(plan))
    out: list[tuple[Example, str | None]] = []
    seen: set[str] = set()
    for want in plan:
        while True:
            if want is None:
                ex = _other_question(rng)
                ex = Example("tools", ex.prompt, ex.answer, system)
            else:
                q, args = _tool_question(rng, want)
                answer = _CANNOT[want] if want == "price" else _call(want, args)
                ex = Example("tools", q, answer, system)
            if ex.prompt not in seen:
                break
        seen.add(ex.prompt)
        out.append((ex, want if want != "price" else None))
    return out


# -- adapter tasks (the base model never sees these instructions) -----------------------------------


def reverse(rng: random.Random) -> Example:
    while True:
        items = _items(rng, LOWER_WORDS, 2, 5)
        if items != items[::-1]:  # a palindrome would let plain copying pass as reversal
            break
    return Example("reverse", f"Reverse the words: {' '.join(items)}", " ".join(reversed(items)))


def uppercase(rng: random.Random) -> Example:
    items = _items(rng, tuple(WORDS) + tuple(ACCENTED), 1, 5)
    text = " ".join(items)
    return Example("uppercase", f"Uppercase: {text}", text.upper())


def sort_numbers(rng: random.Random) -> Example:
    while True:
        nums = [int(x) for x in _items(rng, NUMBERS, 3, 5, distinct=True)]
        if nums != sorted(nums):  # already sorted input would let copying pass as sorting
            break
    return Example("sort", f"Sort the numbers: {' '.join(map(str, nums))}", " ".join(map(str, sorted(nums))))


def extract(rng: random.Random) -> Example:
    """Copy one field of a record out verbatim, with its label: the note (4-12 items), among fields in random
    order. The kit's copy-heavy task -- the answer is a span of the prompt, which prompt-lookup drafting predicts.
    (The label is what the copy keys on: answering the bare note, a 4-layer model's adapter learnt to copy all
    but the note's first item -- 2.5% exact after 800 steps.)"""
    note = " ".join(_repeat_item(rng) for _ in range(rng.randint(4, 12)))
    fields = [f"from: {rng.choice(WEATHER_CITIES)}", f"to: {rng.choice(WEATHER_CITIES)}", f"note: {note}"]
    rng.shuffle(fields)
    return Example("extract", "Extract the note:\n" + "\n".join(fields), f"note: {note}")


def opposites(rng: random.Random) -> Example:
    items = _items(rng, ANTONYM_WORDS, 1, 4)
    return Example("opposites", f"Opposites: {' '.join(items)}", " ".join(OPPOSITE[w] for w in items))


Task = Callable[[random.Random], Example]

# The base tasks asked without tools (the `tools` task asks them with tools offered too).
_PLAIN_TASKS: dict[str, Task] = {"fact": fact, "capital": capital, "add": add, "repeat": repeat, "count": count}
# Mixture weights of the base model's training stream.
BASE_TASKS: dict[str, tuple[Task, float]] = {
    "fact": (fact, 0.16),
    "capital": (capital, 0.24),
    "add": (add, 0.16),
    "repeat": (repeat, 0.6),
    "count": (count, 0.18),
    "tools": (tools, 0.3),
}
# Eval set composition for the base model (task -> number of examples).
BASE_EVAL: dict[str, int] = {"fact": 8, "capital": 12, "add": 6, "repeat": 8, "count": 6}

ADAPTER_TASKS: dict[str, Task] = {
    "reverse": reverse,
    "uppercase": uppercase,
    "sort": sort_numbers,
    "opposites": opposites,
    "extract": extract,
}
_FIXED_TASKS = {"fact": len(FACTS), "capital": len(CAPITALS) * len(_CAPITAL_QUESTIONS), "add": 100}


def eval_set(tasks: dict[str, Task], sizes: dict[str, int], seed: int) -> list[Example]:
    """Distinct eval examples per task (prompt-unique), drawn from a stream separate from training."""
    rng = random.Random(f"eval:{seed}:{','.join(sizes)}")
    out: list[Example] = []
    for name, n in sizes.items():
        seen: set[str] = set()
        while len(seen) < n:
            ex = tasks[name](rng)
            if ex.prompt not in seen:
                seen.add(ex.prompt)
                out.append(ex)
    return out


def base_eval_set(seed: int) -> list[Example]:
    return eval_set({k: t for k, (t, _) in BASE_TASKS.items()}, BASE_EVAL, seed)


def base_held_out(seed: int, tool_eval_size: int) -> set[str]:
    """The prompts the base model's training (and the draft model's) skips: the base and tool evals'."""
    return {e.prompt for e in base_eval_set(seed)} | {e.prompt for e, _ in tool_eval_set(seed, tool_eval_size)}


def adapter_eval_set(task: str, n: int, seed: int) -> list[Example]:
    return eval_set({task: ADAPTER_TASKS[task]}, {task: n}, seed)


def training_stream(
    tasks: dict[str, tuple[Task, float]], seed: int, *, exclude: set[str] = frozenset()
) -> Iterator[Example]:
    """An endless seeded stream; list tasks skip prompts held out for eval, fact tasks keep them."""
    rng = random.Random(f"train:{seed}:{','.join(tasks)}")
    names = list(tasks)
    weights = [w for _, w in tasks.values()]
    while True:
        name = rng.choices(names, weights)[0]
        ex = tasks[name][0](rng)
        if name not in _FIXED_TASKS and ex.prompt in exclude:
            continue
        yield ex


def base_training(seed: int, n: int, exclude: set[str]) -> list[Example]:
    stream = training_stream(BASE_TASKS, seed, exclude=exclude)
    return [next(stream) for _ in range(n)]


def adapter_training(task: str, seed: int, n: int, exclude: set[str]) -> list[Example]:
    stream = training_stream({task: (ADAPTER_TASKS[task], 1.0)}, seed, exclude=exclude)
    return [next(stream) for _ in range(n)]


# The tokenizer's corpus is frozen at the mixture it was trained on in stop 33 (lists of 1-6 items, the first four
# adapters' tasks): a model's tokenizer does not move when its training mixture does. Measured, too: retrained on
# the mixture with 16-item lists and `extract`, the base model did not learn to copy in 4 of 4 probes (900-1200
# steps); on this tokenizer it did in 2 of 2 (README, "The demo model kit"; why is not understood).
_TOKENIZER_PLAIN: dict[str, tuple[Task, float]] = {
    "fact": (fact, 0.16), "capital": (capital, 0.24), "add": (add, 0.16),
    "repeat": (lambda rng: _repeat_list(rng, 6), 0.26), "count": (count, 0.18)}
_TOKENIZER_TASKS: tuple[Task, ...] = (
    *(t for t, _ in _TOKENIZER_PLAIN.values()), lambda rng: tools(rng, _TOKENIZER_PLAIN),
    reverse, uppercase, sort_numbers, opposites)


def tokenizer_corpus(seed: int, n: int) -> Iterator[str]:
    """Text the BPE is trained on: every task of the frozen tokenizer mixture (above), base and adapters."""
    rng = random.Random(f"tok:{seed}")
    every: list[Task] = list(_TOKENIZER_TASKS)
    for _ in range(n):
        ex = rng.choice(every)(rng)
        if ex.system:
            yield ex.system
        yield ex.prompt
        yield ex.answer
