"""A seeded fictional world written as short encyclopedia pages with links, for the browse env.

Nothing in it is real, so no model knows the answers. Names come from syllable tables. Train worlds
(seed < HELD_OUT_SEED) start every name with a consonant from one set and held-out worlds with one
from a disjoint set, so no entity name, hence no question, is shared between the two. Small name
pools make distractors: people sharing a surname or a whole name (told apart by occupation),
companies named after the same family, products of one line, events named after a city that did not
host them. A page's mentions of other pages are links, numbered ``[1]``, ``[2]``, ... per page.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

from compactrl.envs.base import HELD_OUT_SEED

TRAIN_ONSETS, HELD_OUT_ONSETS = "b d f g k l m h".split(), "n p r s t v z j".split()
MID_ONSETS = "b d f g k l m n p r s t v z".split()
VOWELS = "a e i o u a e o ai ei".split()
CODAS = "n r l s x th m nd".split()
OCCUPATIONS = "botanist engineer painter surveyor chemist architect sailor composer printer weaver".split()
ORG_SUFFIXES = "Works Foundry Company Industries Laboratories Guild Brothers Mills".split()
PRODUCTS = "engine loom lamp radio clock pump telescope bicycle camera press".split()
EVENTS = "Fair Festival Congress Exhibition Games Summit Regatta Expo".split()
# each kind's relations to other entities: (relation, target kind)
RELATIONS = {
    "person": (("born_in", "city"), ("worked_for", "org"), ("married_to", "person")),
    "org": (("founded_by", "person"), ("headquartered_in", "city")),
    "product": (("built_by", "org"),),
    "city": (("mayor", "person"),),
    "event": (("held_in", "city"), ("organised_by", "org")),
}
# capitalised words of titles and questions that are no name: a name is never one of them, so a train
# question (its first title starts with a train onset) never reads like a held-out one
RESERVED = {*ORG_SUFFIXES, *EVENTS, "In", "Which", "Who", "How", "What"}
SHARES = {"city": 0.15, "person": 0.35, "org": 0.2, "product": 0.15, "event": 0.15}


@dataclass
class Entity:
    id: int
    kind: str
    name: str
    title: str  # the name, with a disambiguator where two entities share it
    detail: str  # occupation, product kind, ...
    year: int  # born, founded, introduced or held
    number: int = 0  # population (city), employees (org)
    rel: dict[str, int] = field(default_factory=dict)

    @property
    def mention(self) -> str:
        return f"the {self.title}" if self.kind in ("product", "event") else self.title


@dataclass
class Page:
    id: int
    title: str
    text: str  # with link markers, e.g. "born in Velmar [1] in 1890."
    plain: str  # the same without markers (search snippets and the index)
    links: tuple[int, ...]  # link id k (1-based) leads to page links[k - 1]


@dataclass
class World:
    seed: int
    entities: list[Entity]
    pages: list[Page]


def _word(rng: random.Random, onsets: list[str], syllables: int) -> str:
    while True:
        w = rng.choice(onsets) + rng.choice(VOWELS)
        for _ in range(syllables - 1):
            w += rng.choice(MID_ONSETS) + rng.choice(VOWELS)
        w = (w + (rng.choice(CODAS) if rng.random() < 0.5 else "")).capitalize()
        if w not in RESERVED:
            return w


def build_world(seed: int, size: int = 120) -> World:
    """``size`` entities (pages) of five kinds, their facts and relations, deterministic in ``seed``."""
    rng = random.Random(f"browse/world/{seed}")
    onsets = HELD_OUT_ONSETS if seed >= HELD_OUT_SEED else TRAIN_ONSETS
    counts = {k: max(3, round(size * s)) for k, s in SHARES.items()}
    used: set[str] = set()

    def fresh(make) -> str:
        for _ in range(1000):
            if (n := make()) not in used:
                used.add(n)
                return n
        raise ValueError(f"cannot draw {size} distinct names; use a smaller world")

    ents: list[Entity] = []

    def add(kind, name, detail, year, number=0) -> Entity:
        ents.append(Entity(len(ents), kind, name, name, detail, year, number))
        return ents[-1]

    cities = [add("city", fresh(lambda: _word(rng, onsets, rng.choice((2, 3)))), "city",
                  rng.randint(1000, 1700), rng.randint(20, 900) * 1000 + rng.randint(0, 999))
              for _ in range(counts["city"])]  # fmt: skip
    surnames = [_word(rng, onsets, 2) for _ in range(max(2, counts["person"] // 3))]
    people: list[Entity] = []
    for _ in range(counts["person"]):
        name, jobs = (rng.choice(people).name, OCCUPATIONS) if people and rng.random() < 0.12 else ("", ())
        jobs = [j for j in jobs if j not in {p.detail for p in people if p.name == name}]
        if not jobs:  # not a namesake (one, of a new occupation, shares a name and is told apart by it)
            name, jobs = fresh(lambda: f"{_word(rng, onsets, 2)} {rng.choice(surnames)}"), OCCUPATIONS
        people.append(add("person", name, rng.choice(jobs), rng.randint(1800, 1960)))
    orgs = [add("org", fresh(lambda: f"{rng.choice(surnames)} {rng.choice(ORG_SUFFIXES)}"), "company", 0,
                rng.randint(20, 5000)) for _ in range(counts["org"])]  # fmt: skip
    lines = [_word(rng, onsets, 2) for _ in range(max(2, counts["product"] // 2))]
    products = [add("product", fresh(lambda: f"{rng.choice(lines)} {rng.choice(PRODUCTS)}"), "", 0)
                for _ in range(counts["product"])]  # fmt: skip
    events = [add("event", fresh(lambda: f"{rng.choice(cities).name} {rng.choice(EVENTS)}"), "event", 0)
              for _ in range(counts["event"])]  # fmt: skip
    _disambiguate(people)

    for p in people:
        p.rel.update(born_in=rng.choice(cities).id, worked_for=rng.choice(orgs).id)
    singles = [p for p in people if rng.random() < 0.6]
    for a, b in zip(singles[::2], singles[1::2]):
        a.rel["married_to"], b.rel["married_to"] = b.id, a.id
    for o in orgs:
        founder = rng.choice([p for p in people if p.year < 1940])
        o.rel.update(founded_by=founder.id, headquartered_in=rng.choice(cities).id)
        o.year = founder.year + rng.randint(20, 50)
    for p in products:
        maker = rng.choice(orgs)
        p.detail, p.year, p.rel["built_by"] = p.name.split()[-1], maker.year + rng.randint(1, 40), maker.id
    for e in events:
        org = rng.choice(orgs)
        e.rel.update(held_in=rng.choice(cities).id, organised_by=org.id)
        e.year = org.year + rng.randint(1, 60)
    for c in cities:
        c.rel["mayor"] = rng.choice(people).id
    return World(seed, ents, [_page(ents, e) for e in ents])


def _disambiguate(people: list[Entity]) -> None:
    """Namesakes (who differ in occupation) get it in their titles, as an encyclopedia does."""
    names = [p.name for p in people]
    for p in people:
        if names.count(p.name) > 1:
            p.title = f"{p.name} ({p.detail})"


def _sentences(ents: list[Entity], e: Entity) -> list[str]:
    """The page's text with ``{id}`` where it mentions entity ``id``."""
    r, t, a = e.rel, e.title, "an" if e.detail[0] in "aeiou" else "a"
    if e.kind == "person":
        s = [f"{t} was {a} {e.detail} born in {{{r['born_in']}}} in {e.year}.",
             f"{e.name} worked for {{{r['worked_for']}}}."]  # fmt: skip
        if "married_to" in r:
            s.append(f"{e.name} was married to {{{r['married_to']}}}.")
        s += [f"{e.name} founded {{{o.id}}}." for o in ents if o.rel.get("founded_by") == e.id][:2]
    elif e.kind == "org":
        s = [f"{t} is a company founded by {{{r['founded_by']}}} in {e.year}.",
             f"It is based in {{{r['headquartered_in']}}} and has {e.number:,} employees."]  # fmt: skip
        made = [f"the {{{p.id}}}" for p in ents if p.rel.get("built_by") == e.id][:3]
        s += [f"It built {' and '.join(made)}."] if made else []
    elif e.kind == "product":
        s = [f"The {t} is {a} {e.detail} introduced in {e.year}.", f"It was built by {{{r['built_by']}}}."]
    elif e.kind == "city":
        s = [f"{t} is a city founded in {e.year}, with a population of {e.number:,}.",
             f"Its mayor is {{{r['mayor']}}}."]  # fmt: skip
    else:
        s = [f"The {t} is an event held in {{{r['held_in']}}} in {e.year}.",
             f"It was organised by {{{r['organised_by']}}}."]  # fmt: skip
    return s


def _page(ents: list[Entity], e: Entity) -> Page:
    raw = " ".join(_sentences(ents, e))
    links: list[int] = []

    def marked(m: re.Match) -> str:
        i = int(m.group(1))
        if i not in links:
            links.append(i)
        return f"{ents[i].title} [{links.index(i) + 1}]"

    text = re.sub(r"\{(\d+)\}", marked, raw)
    plain = re.sub(r"\{(\d+)\}", lambda m: ents[int(m.group(1))].title, raw)
    return Page(e.id, e.title, text, plain, tuple(links))
