"""The synthetic facts of the memory-patches study (`data/memory_facts.jsonl`) and their generator.

Each fact is about an invented person, so neither a pretrained model (SmolLM2-135M) nor one trained
on the King James Bible can know it before it is written into Engram rows (or a LoRA). Its value is
real general knowledge (a city, a language, an instrument, ...), so an indirect question can test
whether the written fact combines with what the model already knows. Every record has the direct
cloze prompt, two paraphrases, one indirect question and two neighbour prompts that must not change.
Deterministic (one `random.Random(0)`, stdlib only): `python -m engram.apps.study.facts_gen`
rewrites the shipped files, and `generate_facts(n)` is the first n records of `generate_facts(1300)`.
The study writes facts from the first 1,000 (`data/memory_facts.jsonl`); the next 300
(`data/reader_facts.jsonl`, other subjects) are what its reader-patch arm trains the readers on, so one
set of readers serves every seed and size, up to all 1,000 facts.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import product
from pathlib import Path
from typing import Any, Generic, TypeVar

__all__ = [
    "FACTS",
    "FACTS_PATH",
    "READER_FACTS",
    "READER_FACTS_PATH",
    "RELATIONS",
    "Relation",
    "facts_jsonl",
    "generate_facts",
    "main",
]

FACTS_PATH = Path(__file__).with_name("data") / "memory_facts.jsonl"
READER_FACTS_PATH = Path(__file__).with_name("data") / "reader_facts.jsonl"
FACTS = 1000  # in FACTS_PATH: the facts the study writes
READER_FACTS = 300  # in READER_FACTS_PATH: the next ones, for training readers

# Invented names: pronounceable, not real words and not famous people. Subjects are every pairing of
# a given and a family name; the neighbours' invented people come from pools of their own, so that no
# neighbour prompt shares a name (and so an Engram n-gram of a name) with any written fact.
GIVEN_NAMES: tuple[str, ...] = (
    "Talven", "Orsela", "Quintar", "Dovrin", "Maelis", "Corvan", "Jessamar", "Brannoc",
    "Ilvera", "Tobrin", "Savella", "Keverin", "Anzelo", "Rubane", "Pellamy", "Odrana",
    "Fennick", "Lisavet", "Gorwen", "Hestany", "Varrel", "Noemra", "Caddoc", "Teressin",
    "Wulmar", "Ysmara", "Belwin", "Ardessa", "Morvick", "Selvane", "Harrand", "Idrella",
    "Kestrin", "Lunessa", "Mabrin", "Nerith", "Oswic", "Pirella", "Rastigan", "Tamsel",
    "Ulvena", "Vesperin", "Wendric", "Zanthe", "Eldrin", "Aubrel", "Crisanth", "Jorvane",
)  # fmt: skip
FAMILY_NAMES: tuple[str, ...] = (
    "Orrik", "Quellmar", "Vasquell", "Thrennick", "Delavorne", "Marrowby", "Kettlemore", "Oskarth",
    "Pellgrave", "Ravensholt", "Ironvale", "Stellick", "Brackwater", "Dunmorrow", "Feldranne", "Garrowind",
    "Hollistane", "Jarrowick", "Kilbarren", "Lothmere", "Morvayne", "Nettleharrow", "Ombrevelle", "Pardoveth",
    "Quillowen", "Raskell", "Sallowmere", "Tarrenhall", "Umbrathil", "Varnholme", "Wexmoor", "Yarrowdene",
    "Zellaford", "Ashvellin", "Belthorne", "Cindermoss", "Drayvenholt", "Esterhune", "Fallowick", "Grimsael",
    "Harnacle", "Invermoth", "Kestermane", "Lorrimund", "Maddersleigh", "Norrvik", "Ottervayne", "Pellharrow",
)  # fmt: skip
NEIGHBOUR_GIVEN_NAMES: tuple[str, ...] = (
    "Merin", "Jassen", "Tirra", "Bolvar", "Ennith", "Gaspen", "Lirrow", "Mordane",
    "Pettra", "Quorin", "Sabbeth", "Tovin", "Ullene", "Wrenna", "Yestin", "Zarabel",
)  # fmt: skip
NEIGHBOUR_FAMILY_NAMES: tuple[str, ...] = (
    "Dask", "Brunwick", "Callowen", "Drisk", "Emberleigh", "Frostamel", "Gellick", "Hobbart",
    "Inchmore", "Jorlith", "Kravane", "Lisk", "Mattorin", "Nibbet", "Pollendrake", "Quistle",
)  # fmt: skip

# (city, country, continent). Left out on purpose: cities whose name is also a country (Singapore),
# or is shared by another well-known city (Birmingham, Perth, Valencia); countries written with
# "the" or with a constituent-country ambiguity (the United States, the Netherlands, England or the
# United Kingdom); cities whose continent is argued (Istanbul, Auckland).
CITIES: tuple[tuple[str, str, str], ...] = (
    ("Lisbon", "Portugal", "Europe"),
    ("Madrid", "Spain", "Europe"),
    ("Barcelona", "Spain", "Europe"),
    ("Paris", "France", "Europe"),
    ("Lyon", "France", "Europe"),
    ("Rome", "Italy", "Europe"),
    ("Milan", "Italy", "Europe"),
    ("Naples", "Italy", "Europe"),
    ("Berlin", "Germany", "Europe"),
    ("Munich", "Germany", "Europe"),
    ("Vienna", "Austria", "Europe"),
    ("Zurich", "Switzerland", "Europe"),
    ("Brussels", "Belgium", "Europe"),
    ("Stockholm", "Sweden", "Europe"),
    ("Oslo", "Norway", "Europe"),
    ("Copenhagen", "Denmark", "Europe"),
    ("Helsinki", "Finland", "Europe"),
    ("Dublin", "Ireland", "Europe"),
    ("Warsaw", "Poland", "Europe"),
    ("Budapest", "Hungary", "Europe"),
    ("Athens", "Greece", "Europe"),
    ("Bucharest", "Romania", "Europe"),
    ("Reykjavik", "Iceland", "Europe"),
    ("Moscow", "Russia", "Europe"),
    ("Tokyo", "Japan", "Asia"),
    ("Osaka", "Japan", "Asia"),
    ("Kyoto", "Japan", "Asia"),
    ("Seoul", "South Korea", "Asia"),
    ("Busan", "South Korea", "Asia"),
    ("Beijing", "China", "Asia"),
    ("Shanghai", "China", "Asia"),
    ("Mumbai", "India", "Asia"),
    ("Kolkata", "India", "Asia"),
    ("Chennai", "India", "Asia"),
    ("Bangkok", "Thailand", "Asia"),
    ("Hanoi", "Vietnam", "Asia"),
    ("Jakarta", "Indonesia", "Asia"),
    ("Kuala Lumpur", "Malaysia", "Asia"),
    ("Karachi", "Pakistan", "Asia"),
    ("Lahore", "Pakistan", "Asia"),
    ("Dhaka", "Bangladesh", "Asia"),
    ("Tehran", "Iran", "Asia"),
    ("Baghdad", "Iraq", "Asia"),
    ("Riyadh", "Saudi Arabia", "Asia"),
    ("Kathmandu", "Nepal", "Asia"),
    ("Tashkent", "Uzbekistan", "Asia"),
    ("Cairo", "Egypt", "Africa"),
    ("Lagos", "Nigeria", "Africa"),
    ("Nairobi", "Kenya", "Africa"),
    ("Addis Ababa", "Ethiopia", "Africa"),
    ("Accra", "Ghana", "Africa"),
    ("Dakar", "Senegal", "Africa"),
    ("Casablanca", "Morocco", "Africa"),
    ("Tunis", "Tunisia", "Africa"),
    ("Algiers", "Algeria", "Africa"),
    ("Johannesburg", "South Africa", "Africa"),
    ("Cape Town", "South Africa", "Africa"),
    ("Kampala", "Uganda", "Africa"),
    ("Luanda", "Angola", "Africa"),
    ("Dar es Salaam", "Tanzania", "Africa"),
    ("Khartoum", "Sudan", "Africa"),
    ("Harare", "Zimbabwe", "Africa"),
    ("Lusaka", "Zambia", "Africa"),
    ("Maputo", "Mozambique", "Africa"),
    ("Toronto", "Canada", "North America"),
    ("Vancouver", "Canada", "North America"),
    ("Montreal", "Canada", "North America"),
    ("Ottawa", "Canada", "North America"),
    ("Calgary", "Canada", "North America"),
    ("Mexico City", "Mexico", "North America"),
    ("Guadalajara", "Mexico", "North America"),
    ("Monterrey", "Mexico", "North America"),
    ("Havana", "Cuba", "North America"),
    ("Buenos Aires", "Argentina", "South America"),
    ("Sao Paulo", "Brazil", "South America"),
    ("Rio de Janeiro", "Brazil", "South America"),
    ("Brasilia", "Brazil", "South America"),
    ("Lima", "Peru", "South America"),
    ("Bogota", "Colombia", "South America"),
    ("Medellin", "Colombia", "South America"),
    ("Quito", "Ecuador", "South America"),
    ("Caracas", "Venezuela", "South America"),
    ("Montevideo", "Uruguay", "South America"),
    ("Asuncion", "Paraguay", "South America"),
    ("Sydney", "Australia", "Australia"),
    ("Melbourne", "Australia", "Australia"),
    ("Brisbane", "Australia", "Australia"),
    ("Adelaide", "Australia", "Australia"),
)

# (profession, the kind of place where it is practised). Every profession starts with a consonant
# sound, so the prompt's "works as a" is grammatical for all of them.
PROFESSIONS: tuple[tuple[str, str], ...] = (
    ("teacher", "school"),
    ("nurse", "hospital"),
    ("surgeon", "hospital"),
    ("librarian", "library"),
    ("baker", "bakery"),
    ("pharmacist", "pharmacy"),
    ("farmer", "farm"),
    ("miner", "mine"),
    ("mechanic", "garage"),
    ("firefighter", "fire station"),
    ("judge", "courthouse"),
    ("brewer", "brewery"),
    ("winemaker", "winery"),
    ("blacksmith", "forge"),
    ("zookeeper", "zoo"),
    ("chef", "restaurant"),
    ("waiter", "restaurant"),
    ("barber", "barbershop"),
    ("banker", "bank"),
    ("postman", "post office"),
    ("curator", "museum"),
    ("florist", "flower shop"),
    ("bookseller", "bookshop"),
    ("professor", "university"),
)

# (instrument, its family in the usual orchestral classification).
INSTRUMENTS: tuple[tuple[str, str], ...] = (
    ("violin", "string"),
    ("viola", "string"),
    ("cello", "string"),
    ("double bass", "string"),
    ("harp", "string"),
    ("guitar", "string"),
    ("banjo", "string"),
    ("mandolin", "string"),
    ("sitar", "string"),
    ("ukulele", "string"),
    ("trumpet", "brass"),
    ("trombone", "brass"),
    ("tuba", "brass"),
    ("French horn", "brass"),
    ("cornet", "brass"),
    ("euphonium", "brass"),
    ("flugelhorn", "brass"),
    ("flute", "woodwind"),
    ("clarinet", "woodwind"),
    ("oboe", "woodwind"),
    ("bassoon", "woodwind"),
    ("piccolo", "woodwind"),
    ("saxophone", "woodwind"),
    ("recorder", "woodwind"),
    ("xylophone", "percussion"),
    ("marimba", "percussion"),
    ("timpani", "percussion"),
    ("snare drum", "percussion"),
    ("glockenspiel", "percussion"),
    ("vibraphone", "percussion"),
    ("tambourine", "percussion"),
    ("piano", "keyboard"),
    ("organ", "keyboard"),
    ("harpsichord", "keyboard"),
)

# (language, the script it is written in). Languages named like their own script (Greek, Arabic,
# Hebrew, Thai, ...) are left out: their indirect answer would repeat the direct one.
LANGUAGES: tuple[tuple[str, str], ...] = (
    ("English", "Latin"),
    ("French", "Latin"),
    ("Spanish", "Latin"),
    ("Portuguese", "Latin"),
    ("Italian", "Latin"),
    ("German", "Latin"),
    ("Polish", "Latin"),
    ("Turkish", "Latin"),
    ("Vietnamese", "Latin"),
    ("Swahili", "Latin"),
    ("Russian", "Cyrillic"),
    ("Ukrainian", "Cyrillic"),
    ("Bulgarian", "Cyrillic"),
    ("Belarusian", "Cyrillic"),
    ("Macedonian", "Cyrillic"),
    ("Persian", "Arabic"),
    ("Urdu", "Arabic"),
    ("Pashto", "Arabic"),
    ("Hindi", "Devanagari"),
    ("Marathi", "Devanagari"),
    ("Nepali", "Devanagari"),
    ("Korean", "Hangul"),
)

# (pet, the group of animals it belongs to).
PETS: tuple[tuple[str, str], ...] = (
    ("hamster", "mammals"),
    ("rabbit", "mammals"),
    ("ferret", "mammals"),
    ("gerbil", "mammals"),
    ("guinea pig", "mammals"),
    ("chinchilla", "mammals"),
    ("hedgehog", "mammals"),
    ("parrot", "birds"),
    ("canary", "birds"),
    ("budgerigar", "birds"),
    ("cockatiel", "birds"),
    ("finch", "birds"),
    ("tortoise", "reptiles"),
    ("gecko", "reptiles"),
    ("chameleon", "reptiles"),
    ("iguana", "reptiles"),
    ("corn snake", "reptiles"),
    ("goldfish", "fish"),
    ("guppy", "fish"),
    ("koi", "fish"),
    ("frog", "amphibians"),
    ("toad", "amphibians"),
    ("newt", "amphibians"),
    ("salamander", "amphibians"),
    ("axolotl", "amphibians"),
)

# (sport, what its players swing). Only sports played by swinging one implement.
SPORTS: tuple[tuple[str, str], ...] = (
    ("tennis", "racket"),
    ("badminton", "racket"),
    ("squash", "racket"),
    ("golf", "club"),
    ("baseball", "bat"),
    ("cricket", "bat"),
    ("softball", "bat"),
    ("ice hockey", "stick"),
    ("field hockey", "stick"),
    ("lacrosse", "stick"),
    ("polo", "mallet"),
    ("croquet", "mallet"),
)

# (football club, the city it is based in). Clubs whose name contains their city (Real Madrid,
# FC Porto) are left out, so the indirect question cannot be read off the club's name.
FOOTBALL_CLUBS: tuple[tuple[str, str], ...] = (
    ("Juventus", "Turin"),
    ("Lazio", "Rome"),
    ("Fiorentina", "Florence"),
    ("Sampdoria", "Genoa"),
    ("Atalanta", "Bergamo"),
    ("Ajax", "Amsterdam"),
    ("Feyenoord", "Rotterdam"),
    ("PSV", "Eindhoven"),
    ("Benfica", "Lisbon"),
    ("Sporting CP", "Lisbon"),
    ("Celtic", "Glasgow"),
    ("Rangers", "Glasgow"),
    ("Arsenal", "London"),
    ("Chelsea", "London"),
    ("Tottenham Hotspur", "London"),
    ("Everton", "Liverpool"),
    ("Real Betis", "Seville"),
    ("Real Sociedad", "San Sebastian"),
    ("Hertha BSC", "Berlin"),
    ("Schalke 04", "Gelsenkirchen"),
    ("Galatasaray", "Istanbul"),
    ("Fenerbahce", "Istanbul"),
    ("Besiktas", "Istanbul"),
    ("Panathinaikos", "Athens"),
    ("Boca Juniors", "Buenos Aires"),
    ("River Plate", "Buenos Aires"),
    ("Flamengo", "Rio de Janeiro"),
    ("Fluminense", "Rio de Janeiro"),
    ("Corinthians", "Sao Paulo"),
    ("Palmeiras", "Sao Paulo"),
    ("Penarol", "Montevideo"),
    ("Al Ahly", "Cairo"),
    ("Kaizer Chiefs", "Johannesburg"),
    ("Orlando Pirates", "Johannesburg"),
)


@dataclass(frozen=True)
class Relation:
    """One kind of fact. Templates take the subject as `{s}`; `values` pairs each direct answer with
    the answer to the indirect question; the direct template, filled with a neighbour's invented name,
    is one neighbour prompt, and `real_neighbours` (real, well-known subjects asked the same kind of
    question) supply the other."""

    name: str
    prompt: str
    paraphrases: tuple[str, str]
    indirect: str
    values: tuple[tuple[str, str], ...]
    real_neighbours: tuple[str, ...]


RELATIONS: tuple[Relation, ...] = (
    Relation(
        "lives_in",
        "{s} lives in the city of",
        ("The home city of {s} is", "Q: In which city does {s} live? A:"),
        "{s} lives in a city in the country of",
        tuple((city, country) for city, country, _ in CITIES),
        (
            "The Eiffel Tower stands in the city of",
            "The Colosseum stands in the city of",
            "The Brandenburg Gate stands in the city of",
            "The Acropolis stands in the city of",
            "The Kremlin stands in the city of",
            "The Statue of Liberty stands in the city of",
            "The Taj Mahal stands in the city of",
            "The Sagrada Familia stands in the city of",
            "Big Ben stands in the city of",
            "The Golden Gate Bridge stands in the city of",
        ),
    ),
    Relation(
        "born_in",
        "{s} was born in the city of",
        ("The birthplace of {s} is the city of", "Q: In which city was {s} born? A:"),
        "{s} was born on the continent of",
        tuple((city, continent) for city, _, continent in CITIES),
        (
            "Wolfgang Amadeus Mozart was born in the city of",
            "Ludwig van Beethoven was born in the city of",
            "Albert Einstein was born in the city of",
            "Galileo Galilei was born in the city of",
            "Dante Alighieri was born in the city of",
            "Pablo Picasso was born in the city of",
            "Johann Sebastian Bach was born in the city of",
            "Hans Christian Andersen was born in the city of",
            "Karl Marx was born in the city of",
            "Alexander the Great was born in the city of",
        ),
    ),
    Relation(
        "works_as",
        "{s} works as a",
        ("By profession, {s} is a", "Q: What is {s}'s job? A:"),
        "The kind of place where {s} works is a",
        PROFESSIONS,
        (
            "Florence Nightingale worked as a",
            "Amelia Earhart worked as a",
            "Sherlock Holmes worked as a",
            "Hippocrates worked as a",
            "Pablo Picasso worked as a",
            "Wolfgang Amadeus Mozart worked as a",
            "Harry Houdini worked as a",
            "Coco Chanel worked as a",
            "Yuri Gagarin worked as a",
            "Charles Dickens worked as a",
        ),
    ),
    Relation(
        "plays_instrument",
        "{s} is a musician who plays the",
        ("The instrument played by {s} is the", "Q: Which musical instrument does {s} play? A:"),
        "{s} plays an instrument from the",
        tuple((instrument, f"{family} family") for instrument, family in INSTRUMENTS),
        (
            "Jimi Hendrix was a musician who played the",
            "Louis Armstrong was a musician who played the",
            "Ravi Shankar was a musician who played the",
            "Niccolo Paganini was a musician who played the",
            "John Coltrane was a musician who played the",
            "Miles Davis was a musician who played the",
            "Benny Goodman was a musician who played the",
            "Frederic Chopin was a musician who played the",
            "Pablo Casals was a musician who played the",
            "Ringo Starr is a musician who plays the",
        ),
    ),
    Relation(
        "native_language",
        "The native language of {s} is",
        ("{s}'s mother tongue is", "Q: What is {s}'s first language? A:"),
        "The script used to write the native language of {s} is",
        LANGUAGES,
        (
            "The native language of Leo Tolstoy was",
            "The native language of Victor Hugo was",
            "The native language of Miguel de Cervantes was",
            "The native language of Johann Wolfgang von Goethe was",
            "The native language of Rabindranath Tagore was",
            "The native language of Fernando Pessoa was",
            "The native language of Hans Christian Andersen was",
            "The native language of Henrik Ibsen was",
            "The native language of Adam Mickiewicz was",
            "The native language of Confucius was",
        ),
    ),
    Relation(
        "has_pet",
        "{s} has a pet",
        ("At home, {s} keeps a pet", "Q: What animal does {s} keep as a pet? A:"),
        "{s}'s pet belongs to the group of animals called",
        PETS,
        (
            "In The Wizard of Oz, Dorothy has a pet",
            "In the Harry Potter books, Harry has a pet",
            "In The Adventures of Tintin, Tintin has a pet",
            "In Peter Pan, the Darling family has a pet",
            "In the film Finding Nemo, Nemo is a young",
            "In the film Babe, Babe is a",
            "In the story Stuart Little, Stuart is a",
            "In the Disney film Bambi, Bambi is a young",
            "In the Disney film Dumbo, Dumbo is a flying",
        ),
    ),
    Relation(
        "plays_sport",
        "The sport that {s} plays is",
        ("{s} competes in the sport of", "Q: Which sport does {s} play? A:"),
        "In the sport {s} plays, players swing a",
        SPORTS,
        (
            "The sport that Roger Federer played professionally is",
            "The sport that Serena Williams played professionally is",
            "The sport that Tiger Woods played professionally is",
            "The sport that Babe Ruth played professionally is",
            "The sport that Sachin Tendulkar played professionally is",
            "The sport that Don Bradman played professionally is",
            "The sport that Wayne Gretzky played professionally is",
            "The sport that Michael Jordan played professionally is",
            "The sport that Pele played professionally is",
            "The sport that Muhammad Ali practised professionally is",
        ),
    ),
    Relation(
        "supports_club",
        "{s} is a lifelong supporter of the football club",
        ("The football club that {s} supports is", "Q: Which football club does {s} support? A:"),
        "{s} supports a football club based in the city of",
        FOOTBALL_CLUBS,
        (
            "Francesco Totti spent his whole career at the football club",
            "Paolo Maldini spent his whole career at the football club",
            "Ryan Giggs spent his whole career at the football club",
            "Carles Puyol spent his whole career at the football club",
            "Matt Le Tissier spent his whole career at the football club",
            "Steven Gerrard spent most of his career at the football club",
            "Franz Beckenbauer spent most of his career at the football club",
            "Eusebio spent most of his career at the football club",
            "Pele spent most of his career at the football club",
            "Johan Cruyff began his career at the football club",
        ),
    ),
)

T = TypeVar("T")


class _Deck(Generic[T]):
    """Deals items in a shuffled order and reshuffles when empty: values spread evenly over the
    records instead of clumping as independent draws would."""

    def __init__(self, items: Iterable[T], rng: random.Random) -> None:
        self._items = list(items)
        self._rng = rng
        self._left: list[T] = []

    def draw(self) -> T:
        if not self._left:
            self._left = list(self._items)
            self._rng.shuffle(self._left)
        return self._left.pop()


def _check_name_pools() -> None:
    """Full names can only contain one another if a given name ends another given name and a family
    name begins another family name; ruling both out over all four pools makes every subject and
    every neighbour name unique and not a substring of any other."""
    pools = (GIVEN_NAMES, FAMILY_NAMES, NEIGHBOUR_GIVEN_NAMES, NEIGHBOUR_FAMILY_NAMES)
    every = [name.lower() for pool in pools for name in pool]
    if len(set(every)) != len(every):
        raise ValueError("a name is repeated across the name pools")
    given = [g.lower() for g in GIVEN_NAMES + NEIGHBOUR_GIVEN_NAMES]
    family = [f.lower() for f in FAMILY_NAMES + NEIGHBOUR_FAMILY_NAMES]
    for a, b in product(given, given):
        if a != b and b.endswith(a):
            raise ValueError(f"given name {a!r} ends {b!r}")
    for a, b in product(family, family):
        if a != b and b.startswith(a):
            raise ValueError(f"family name {a!r} begins {b!r}")


def _record(
    index: int, relation: Relation, subject: str, value: tuple[str, str], neighbours: Sequence[str]
) -> dict[str, Any]:
    answer, indirect_answer = value
    if answer == indirect_answer:
        raise ValueError(f"{relation.name}: indirect answer repeats {answer!r}")
    return {
        "id": f"f{index:04d}",
        "subject": subject,
        "relation": relation.name,
        "prompt": relation.prompt.format(s=subject),
        "target": f" {answer}",
        "paraphrases": [
            {"prompt": p.format(s=subject), "target": f" {answer}"} for p in relation.paraphrases
        ],
        "indirect": {"prompt": relation.indirect.format(s=subject), "target": f" {indirect_answer}"},
        "neighbours": list(neighbours),
    }


def generate_facts(n: int = 1000) -> list[dict[str, Any]]:
    """The first `n` facts: relations in turn (record i has `RELATIONS[i % len(RELATIONS)]`), each subject
    used once. All random draws happen record by record, so a smaller `n` gives a prefix of a larger one."""
    _check_name_pools()
    subjects = [f"{g} {f}" for g, f in product(GIVEN_NAMES, FAMILY_NAMES)]
    if not 0 <= n <= len(subjects):
        raise ValueError(f"n must be in [0, {len(subjects)}] (one invented subject per fact), got {n}")
    rng = random.Random(0)
    rng.shuffle(subjects)
    neighbour_names = [f"{g} {f}" for g, f in product(NEIGHBOUR_GIVEN_NAMES, NEIGHBOUR_FAMILY_NAMES)]
    values = {r.name: _Deck(r.values, rng) for r in RELATIONS}
    invented = {r.name: _Deck(neighbour_names, rng) for r in RELATIONS}
    real = {r.name: _Deck(r.real_neighbours, rng) for r in RELATIONS}
    records = []
    for i in range(n):
        relation = RELATIONS[i % len(RELATIONS)]
        neighbours = (relation.prompt.format(s=invented[relation.name].draw()), real[relation.name].draw())
        records.append(_record(i, relation, subjects[i], values[relation.name].draw(), neighbours))
    return records


def facts_jsonl(records: Iterable[dict[str, Any]]) -> str:
    """The file's text: one ASCII JSON object a line, keys in record order, newline-terminated."""
    return "".join(json.dumps(rec, ensure_ascii=True) + "\n" for rec in records)


def main() -> None:
    """Rewrite the shipped `data/memory_facts.jsonl` (the first 1,000 facts) and `data/reader_facts.jsonl`
    (the next 300)."""
    records = generate_facts(FACTS + READER_FACTS)
    FACTS_PATH.parent.mkdir(exist_ok=True)
    for path, part in ((FACTS_PATH, records[:FACTS]), (READER_FACTS_PATH, records[FACTS:])):
        with open(path, "w", encoding="ascii", newline="\n") as f:
            f.write(facts_jsonl(part))


if __name__ == "__main__":
    main()
