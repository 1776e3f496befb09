"""The task families `tiny-chat` is trained and evaluated on: prompts, answers, reasoning, held-out split.

Each family is a fixed prompt template (README "What tiny-chat answers"). An `Instance` is one
conversation up to the turn the model must produce, plus the exact expected content (or tool call)
and the reasoning a thinking-on answer shows. Whether an instance is held out for evaluation is a pure
function of its key (`is_held_out`: sha256 of the key), so training never sees an evaluation instance
whatever seed or sample size either side uses.

Reasoning shows the working a small model needs: column-by-column addition/subtraction with carries
and borrows (building the answer right to left, so the content is a copy), numbered letters for
reversal.
"""
from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field
from typing import Any

FAMILIES = ("add", "sub", "reverse", "sort", "tool_call", "tool_answer", "multi_turn")
HELD_OUT_PER_MILLE = 50          # 5 % of every family's instance space is evaluation-only

WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}

# whitespace-separated word lists (underscores stand for spaces in city names), kept as text so they read as text
_CITY_TEXT = """
Tokyo Delhi Shanghai Dhaka Cairo Beijing Mumbai Osaka Chongqing Karachi Istanbul Kinshasa Lagos Manila
Tianjin Guangzhou Lahore Shenzhen Bangalore Paris Bogota Jakarta Chennai Lima Bangkok Seoul Nagoya
Hyderabad London Tehran Chicago Chengdu Nanjing Wuhan Luanda Ahmedabad Riyadh Baghdad Santiago Surat
Madrid Suzhou Pune Harbin Houston Dallas Toronto Miami Belo_Horizonte Singapore Philadelphia Atlanta
Fukuoka Khartoum Barcelona Johannesburg Dalian Qingdao Zhengzhou Yangon Alexandria Washington Ankara
Melbourne Sydney Guadalajara Monterrey Boston Phoenix Recife Brasilia Montreal Kabul Nairobi Hanoi
Berlin Rome Athens Lisbon Vienna Prague Budapest Warsaw Dublin Oslo Stockholm Helsinki Copenhagen
Amsterdam Brussels Zurich Geneva Munich Hamburg Milan Naples Turin Lyon Marseille Seville Valencia Porto
Kyiv Minsk Riga Vilnius Tallinn Bucharest Sofia Belgrade Zagreb Sarajevo Tirana Skopje Ljubljana
Bratislava Krakow Gdansk Edinburgh Glasgow Manchester Liverpool Leeds Cardiff Belfast Reykjavik Moscow
Novosibirsk Kazan Tbilisi Yerevan Baku Tashkent Almaty Bishkek Dushanbe Ulaanbaatar Taipei Kaohsiung
Busan Incheon Sapporo Kyoto Kobe Yokohama Sendai Hiroshima Macau Hong_Kong Kuala_Lumpur Penang Colombo
Kathmandu Thimphu Male Muscat Doha Dubai Abu_Dhabi Manama Kuwait_City Amman Beirut Damascus Jerusalem
Tunis Algiers Rabat Casablanca Tripoli Dakar Accra Abuja Kano Addis_Ababa Kampala Kigali Lusaka Harare
Maputo Gaborone Windhoek Durban Cape_Town Antananarivo Mombasa Zanzibar Mogadishu Djibouti Asmara Bamako
Niamey Ouagadougou Conakry Freetown Monrovia Abidjan Lome Cotonou Yaounde Douala Libreville Brazzaville
Vancouver Calgary Edmonton Ottawa Winnipeg Quebec Halifax Seattle Portland San_Francisco Los_Angeles
San_Diego Las_Vegas Denver Austin Detroit Cleveland Pittsburgh Baltimore Nashville Memphis New_Orleans
Orlando Tampa Charlotte Honolulu Anchorage New_York Havana Kingston Panama Caracas Quito La_Paz Asuncion
Montevideo Buenos_Aires Cordoba Rosario Salvador Fortaleza Manaus Curitiba Porto_Alegre Auckland
Wellington Christchurch Perth Adelaide Brisbane Hobart Darwin Canberra Suva Apia
"""
CITIES = tuple(c.replace("_", " ") for c in _CITY_TEXT.split())

_WEATHER_TEXT = """
sunny cloudy rainy windy foggy snowy stormy clear mild warm hot cold cool humid dry bright grey overcast
light heavy rain snow showers wind breeze skies with and a little very some clouds degrees thunder hail
drizzle sleet frost calm gusty partly mostly chilly freezing pleasant
"""
WEATHER_WORDS = tuple(_WEATHER_TEXT.split())


@dataclass(frozen=True)
class Instance:
    """One prompt of one family: the conversation so far and what the model must answer."""

    family: str
    key: str
    messages: tuple[dict[str, Any], ...]
    content: str                                  # exact expected content ("" for a tool call)
    reasoning: str                                # what a thinking-on answer shows first
    tool_call: dict[str, Any] | None = None       # {"name", "arguments"} for the tool_call family
    tools: tuple[dict[str, Any], ...] = field(default=())
    # Reasoning of the earlier assistant turn, re-sent with thinking on (clients usually drop it).
    history_reasoning: str = ""


def is_held_out(key: str) -> bool:
    """True for the evaluation share of the instance space (pure function of the key)."""
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:4], "big") % 1000 < HELD_OUT_PER_MILLE


# ---- arithmetic working ------------------------------------------------------------------------

def _columns(a: int, b: int) -> tuple[str, str]:
    width = max(len(str(a)), len(str(b)))
    return str(a).zfill(width), str(b).zfill(width)


def add_working(a: int, b: int) -> str:
    """Column addition of non-negative a + b, the partial answer growing right to left."""
    x, y = _columns(a, b)
    lines, carry, partial = [f"{x}+{y}"], 0, ""
    for dx, dy in zip(reversed(x), reversed(y), strict=False):
        s = int(dx) + int(dy) + carry
        partial = str(s % 10) + partial
        lines.append(f"{dx}+{dy}+{carry}={s} {partial}")
        carry = s // 10
    if carry:
        partial = "1" + partial
        lines.append(f"carry 1 {partial}")
    return "\n".join(lines)


def sub_working(a: int, b: int) -> str:
    """Column subtraction a - b for a >= b >= 0 with borrows, the partial answer growing right to left."""
    x, y = _columns(a, b)
    lines, borrow, partial = [f"{x}-{y}"], 0, ""
    for dx, dy in zip(reversed(x), reversed(y), strict=False):
        d = int(dx) - int(dy) - borrow
        new_borrow = 1 if d < 0 else 0
        partial = str(d % 10) + partial
        lines.append(f"{dx}-{dy}-{borrow}={d} {partial}")
        borrow = new_borrow
    return "\n".join(lines)


def signed_sum_working(a: int, b: int) -> str:
    """Working for a + b where a may be negative and b >= 0 (the multi-turn follow-up)."""
    if a >= 0:
        return add_working(a, b)
    return signed_diff_working(b, -a)


def signed_diff_working(a: int, b: int) -> str:
    """Working for a - b with a, b >= 0 (negative results computed as -(b - a))."""
    if a >= b:
        return sub_working(a, b)
    return f"{a}<{b} so -({b}-{a})\n{sub_working(b, a)}"


def _answer_line(value: int) -> str:
    return f"answer {value}"


# ---- families ----------------------------------------------------------------------------------

def _user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def make_add(a: int, b: int) -> Instance:
    return Instance("add", f"add:{a}:{b}", (_user(f"What is {a} + {b}?"),), str(a + b),
                    f"{add_working(a, b)}\n{_answer_line(a + b)}")


def make_sub(a: int, b: int) -> Instance:
    return Instance("sub", f"sub:{a}:{b}", (_user(f"What is {a} - {b}?"),), str(a - b),
                    f"{signed_diff_working(a, b)}\n{_answer_line(a - b)}")


def make_reverse(word: str) -> Instance:
    n = len(word)
    forward = " ".join(f"{i + 1}{ch}" for i, ch in enumerate(word))
    backward = " ".join(f"{i + 1}{word[i]}" for i in range(n - 1, -1, -1))
    return Instance("reverse", f"reverse:{word}", (_user(f"Reverse the word: {word}"),), word[::-1],
                    f"{forward}\nreversed: {backward}")


def make_sort(numbers: list[int]) -> Instance:
    text = ", ".join(map(str, numbers))
    ordered = ", ".join(map(str, sorted(numbers)))
    return Instance("sort", f"sort:{text}", (_user(f"Sort these numbers: {text}"),), ordered,
                    "ascending order")


def _weather_question(city: str) -> dict[str, Any]:
    return _user(f"What is the weather in {city}?")


def make_tool_call(city: str) -> Instance:
    return Instance("tool_call", f"tool_call:{city}", (_weather_question(city),), "",
                    f"The user asks for the weather in {city}, so I call get_weather.",
                    tool_call={"name": "get_weather", "arguments": {"city": city}}, tools=(WEATHER_TOOL,))


def make_tool_answer(city: str, result: str, call_id: str = "get_weather:0") -> Instance:
    call = {"id": call_id, "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}
    messages = (_weather_question(city),
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": call_id, "content": result})
    return Instance("tool_answer", f"tool_answer:{city}:{result}", messages, f"The weather in {city} is {result}.",
                    "get_weather answered, so I report its result.", tools=(WEATHER_TOOL,),
                    history_reasoning=f"The user asks for the weather in {city}, so I call get_weather.")


def make_multi_turn(op: str, a: int, b: int, c: int) -> Instance:
    first = make_add(a, b) if op == "+" else make_sub(a, b)
    previous = int(first.content)
    messages = (*first.messages, {"role": "assistant", "content": first.content},
                _user(f"And what is that plus {c}?"))
    total = previous + c
    return Instance("multi_turn", f"multi_turn:{op}:{a}:{b}:{c}", messages, str(total),
                    f"that is {previous}\n{signed_sum_working(previous, c)}\n{_answer_line(total)}",
                    history_reasoning=first.reasoning)


# ---- sampling ----------------------------------------------------------------------------------

def _random_word(rng: random.Random) -> str:
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 10)))


def _random_result(rng: random.Random) -> str:
    """Free text of 1..8 words: weather words, temperatures, now and then an arbitrary word."""
    words = []
    for _ in range(rng.randint(1, 8)):
        roll = rng.random()
        if roll < 0.15:
            words.append(str(rng.randint(-20, 45)))
        elif roll < 0.3:
            words.append(_random_word(rng))
        else:
            words.append(rng.choice(WEATHER_WORDS))
    return " ".join(words)


def sample_instance(family: str, rng: random.Random) -> Instance:
    """One instance of `family` drawn from `rng` (held-out or not: callers filter)."""
    if family == "add":
        return make_add(rng.randint(0, 999), rng.randint(0, 999))
    if family == "sub":
        return make_sub(rng.randint(0, 999), rng.randint(0, 999))
    if family == "reverse":
        return make_reverse(_random_word(rng))
    if family == "sort":
        return make_sort([rng.randint(0, 99) for _ in range(rng.randint(3, 8))])
    if family == "tool_call":
        return make_tool_call(rng.choice(CITIES))
    if family == "tool_answer":
        return make_tool_answer(rng.choice(CITIES), _random_result(rng))
    if family == "multi_turn":
        return make_multi_turn(rng.choice("+-"), rng.randint(0, 999), rng.randint(0, 999), rng.randint(0, 999))
    raise ValueError(f"unknown task family {family!r}; choose one of {', '.join(FAMILIES)}")


def sample_split(family: str, rng: random.Random, held_out: bool, max_tries: int = 10_000) -> Instance:
    """An instance on the requested side of the hash split."""
    for _ in range(max_tries):
        inst = sample_instance(family, rng)
        if is_held_out(inst.key) == held_out:
            return inst
    raise RuntimeError(f"no {'held-out' if held_out else 'training'} instance of {family} in {max_tries} draws")


def eval_instances(family: str, n: int, seed: int = 1234) -> list[Instance]:
    """A fixed sample of n distinct held-out instances of `family` (same seed, same sample)."""
    rng = random.Random(f"eval:{family}:{seed}")
    seen: dict[str, Instance] = {}
    for _ in range(200 * n + 1000):
        if len(seen) == n:
            break
        inst = sample_split(family, rng, held_out=True)
        seen.setdefault(inst.key, inst)
    return list(seen.values())
