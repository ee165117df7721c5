"""Offline haystack text: seeded essay-like prose, a repeated noise paragraph, pseudo-words, and the words of the
needle keys.

RULER fills its haystacks with a repeated noise paragraph and Paul Graham essays. Neither may be downloaded here, so
the essays are generated from a small grammar: varied, natural-looking English whose content never answers a task's
question, deterministic for a given seed.
"""

from __future__ import annotations

import random

NOISE_PARAGRAPH = (
    "The river runs down to the sea. The hills are quiet in the evening. The wind moves across the field. "
    "Here the road bends again. Back and forth we go."
)

_SUBJECTS = (
    "the founder",
    "a small team",
    "the engineer",
    "every investor",
    "the committee",
    "a curious student",
    "the old gardener",
    "the city council",
    "a good editor",
    "the new manager",
    "most writers",
    "the teacher",
    "a careful reader",
    "the board",
    "our neighbour",
    "the historian",
    "a young painter",
    "the mechanic",
    "the crew",
    "a patient doctor",
    "the village",
    "the startup",
    "the library",
    "an early customer",
)
_VERBS = (
    "noticed",
    "built",
    "questioned",
    "described",
    "ignored",
    "rewrote",
    "measured",
    "planned",
    "discovered",
    "explained",
    "admired",
    "postponed",
    "simplified",
    "copied",
    "defended",
    "tested",
    "sketched",
    "funded",
    "remembered",
    "shared",
    "doubted",
    "studied",
    "repaired",
    "finished",
)
_OBJECTS = (
    "the first draft",
    "an unusual idea",
    "the old bridge",
    "a quiet garden",
    "the weekly report",
    "a simple tool",
    "the map of the valley",
    "a long letter",
    "the budget",
    "an honest answer",
    "the prototype",
    "a familiar song",
    "the morning schedule",
    "the broken clock",
    "a hard problem",
    "the museum guide",
    "a better method",
    "the harvest",
    "the winter plan",
    "a short essay",
    "the kitchen table",
    "the recipe",
)
_TAILS = (
    "before anyone else did",
    "without much help",
    "after a long winter",
    "in the spring",
    "for the second time",
    "with surprising care",
    "while the rain kept falling",
    "because it seemed useful",
    "in a single afternoon",
    "despite the noise outside",
    "as everyone expected",
    "long after the deadline",
    "on a Tuesday",
    "with a borrowed pencil",
    "near the harbour",
    "at the end of the season",
    "for reasons nobody recalled",
)
_OPENERS = (
    "",
    "",
    "",
    "In practice, ",
    "Of course, ",
    "Later, ",
    "Surprisingly, ",
    "At first, ",
    "Even so, ",
    "For a while, ",
    "In the end, ",
    "Meanwhile, ",
)
_REMARKS = (
    "It is easy to forget how much work that takes.",
    "Nobody wrote it down at the time.",
    "That is usually how these things begin.",
    "The lesson was not obvious then.",
    "It took years to see why it mattered.",
    "Most people would have stopped there.",
    "The details turned out to be the hard part.",
    "It was not the last time this happened.",
)

# The words of the needle tasks' keys, "<adjective>-<noun>": 270 x 309 = 83,430 keys, enough for niah_multikey_2's
# haystack of distinct distractor keys far beyond 128K tokens. No adjective ends another adjective and no noun begins
# another noun, so no key is a substring of another.
KEY_ADJECTIVES = tuple(
    """
amber bold calm dusty eager faint gentle hollow icy jolly keen lively mellow narrow odd pale quick rusty silent tidy
upbeat vivid wary young zesty brisk crisp dim fierce grand humble lucky noble proud rapid sharp agile ancient arctic
ashen awkward bashful bitter blazing bleak blunt breezy bright brittle bumpy busy candid cheerful chilly clever
cloudy clumsy coastal cosmic cozy crimson cryptic curious curly dapper daring dazzling deft dense dreamy drowsy
dusky earnest elegant empty fancy feisty fluffy foggy frosty frugal fuzzy giddy gloomy glossy golden graceful grumpy
hasty hazy hearty hidden honest husky idle inky jagged jaunty jumpy kind knotty lanky lavish lazy lean lofty loyal
lunar mighty misty modest muddy murky nervous nimble nosy oaken olive ornate patient peppery polished quaint quiet
quirky radiant ragged rosy rough royal rugged rustic salty sandy scarlet serene shaggy shiny shy sleek sleepy
slender sly smoky smooth snowy soggy solemn sombre sparkling speedy spotted stark steady sticky stormy sturdy sunny
swift tame tangled tender thorny thrifty timid tiny tough tranquil tricky velvet vast wavy wealthy weary wild windy
wise witty wobbly wooden woolly zealous zany absent active airy amused balmy barren beige blissful boyish bronze
buoyant chalky charming cobalt cunning dainty dashing dewy dotted dreary dutiful eerie festive fiery flaky fleet
formal fragrant gallant gaunt gifted gleaming grassy greedy hardy hefty hopeful humid jovial joyful lilac lush meek
merry mossy musty naive neat orange pensive placid plump pointy prickly prim rainy regal restless ripe rocky rowdy
rubbery sacred scenic shady silky silver snug spiky stony sugary sullen tawny tepid tidal torn tropical twisted
valiant verdant vocal wandering watery wintry wiry yellow zippy
""".split()
)
KEY_NOUNS = tuple(
    """
anchor badger candle dolphin engine falcon garden harbor island jacket kettle lantern meadow needle orchard pebble
quarry ribbon saddle tunnel violin walnut canyon beacon cobbler ferret glacier hammock magnet oyster parrot rocket
acorn almanac antler apron arrow attic avenue bakery balcony ballad bamboo banjo barrel basket beetle biscuit
blanket bonnet bottle boulder bracelet bridge bucket buffalo bugle cabin cactus camel canoe carpet castle cellar
chimney cinnamon citadel clover compass copper cottage coyote crater cricket crystal cupboard curtain cypress daisy
desert diamond donkey dragon drum eagle easel elbow ember emerald feather fiddle fjord flamingo forest fountain fox
gadget galaxy gazelle geyser giraffe goblet gondola granite griffin guitar hamster harp hedgehog helmet heron
hickory hilltop honey horizon iceberg igloo jaguar jasmine jigsaw jungle kayak kernel kiwi koala ladder lagoon lemon
lighthouse lily lizard lobster locket lotus mango maple meteor mirror mitten monsoon mosaic moth mountain muffin
nectar nest nutmeg oasis octopus onion otter paddle palace panda pantry piano pillow pine planet plum pocket pony
puddle pumpkin puzzle quilt rabbit raccoon radish raven reef river robin saffron sailboat salmon sapphire scarf
scooter seashell shovel sparrow spider spoon squirrel statue summit sunflower swan teapot temple thimble thistle
thunder tiger timber tortoise tower trumpet tulip turnip umbrella valley vase village vulture wagon waterfall whale
whistle willow window wizard wolf yak yacht zebra zeppelin abacus albatross alcove apricot armchair aviary bagpipe
bandstand beaver blossom bobcat bramble buckle butterfly cabbage caravan cathedral cauldron cherry chestnut chisel
comet coral cornfield crane cucumber dandelion dormouse dune elm fern ferry fossil gallery garlic gecko glove
gorilla grotto hazelnut hornet hyacinth jellyfish juniper kestrel kingfisher lettuce lynx mackerel marmot minnow
mussel nightingale oatmeal orchid ostrich pagoda pelican penguin pheasant pickle pigeon porcupine prairie quail
rainbow reindeer rhubarb saucer scallop seagull sheriff skylark snail sphinx stallion stork sycamore tadpole
tambourine toaster toucan trellis trout tugboat vineyard walrus weasel wheelbarrow windmill woodpecker
""".split()
)

_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "gl", "pl", "st", "tr")
_VOWELS = ("a", "e", "i", "o", "u")


def essay_sentence(rng: random.Random) -> str:
    if rng.random() < 0.12:
        return rng.choice(_REMARKS)
    opener = rng.choice(_OPENERS)
    subject = rng.choice(_SUBJECTS)
    if opener:
        first = subject
    else:
        first = subject[0].upper() + subject[1:]
    return f"{opener}{first} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_TAILS)}."


class Essay:
    """An endless, seeded stream of essay sentences; `sentences(n)` is always a prefix of `sentences(n + 1)`."""

    def __init__(self, seed: int | str):
        self._rng = random.Random(f"essay:{seed}")
        self._cache: list[str] = []

    def sentences(self, n: int) -> list[str]:
        while len(self._cache) < n:
            self._cache.append(essay_sentence(self._rng))
        return self._cache[:n]


def pseudo_words(rng: random.Random, n: int, syllables: tuple[int, int] = (2, 3)) -> list[str]:
    """`n` distinct pronounceable made-up words (lower case), e.g. 'dravomi'."""
    seen: set[str] = set()
    out: list[str] = []
    while len(out) < n:
        k = rng.randint(*syllables)
        word = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(k))
        if word not in seen:
            seen.add(word)
            out.append(word)
    return out
