"""The synthetic world of the tiny text-to-image default: coloured shapes on a dark background.

Images are drawn procedurally (thousands per second with numpy masks) and described by prompts
from a small compositional grammar, so a tiny diffusion model can be pretrained on them and a
small classifier (`diffusion_rl.alignment`) can check what a prompt asks for: "GenEval in miniature".

Grammar (lower case, words separated by spaces)::

    prompt   := object [position] | object "and" object
    object   := "a" COLOUR SHAPE | ("two" | "three") COLOUR SHAPE-plural
    position := "on the left" | "on the right" | "at the top" | "at the bottom" | "in the center"

A position follows a single object only, and the two objects of a pair differ in colour or shape.
The prompt sets (`all_prompts`, `train_prompts`, `heldout_prompts`) use three templates:

- count:    "two red circles"            (1-3 objects of one colour and shape, anywhere)
- position: "a blue square on the left"  (one object, in the named region)
- pair:     "a green triangle and a white cross" (one of each)

The parser also reads counts in both halves of a pair ("two red circles and a blue square"),
which the prompt sets do not use.

The 744 prompts split into train and held-out sets: `heldout_pairs(seed)` picks 4 colour-shape
pairs of distinct colours and distinct shapes, and every prompt that mentions one of them is held
out (204 prompts). Held-out prompts are thus new compositions of words seen in training, and
`make_dataset(split="train")` draws images of train pairs only, so pretraining never sees them.

A prompt's scene holds exactly the objects the prompt names, 7-11 px wide at 32 px, not touching.
Coordinates are fractions of the image side, x from the left and y from the top. Regions (of the
object's centre): left x < 3/8, right x > 5/8, top y < 3/8, bottom y > 5/8, center both within
(3/8, 5/8); their edges lie on the 8x8 grid of the alignment scorer. Scenes composed for a position
put the object well inside its region.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from functools import cache, lru_cache
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

# RGB in [0, 1]; the prompts name the colours and shapes, the alignment scorer classifies them
COLOURS: dict[str, tuple[float, float, float]] = {
    "red": (0.90, 0.16, 0.16),
    "green": (0.18, 0.78, 0.22),
    "blue": (0.20, 0.36, 0.95),
    "yellow": (0.95, 0.88, 0.18),
    "purple": (0.62, 0.24, 0.86),
    "white": (0.94, 0.94, 0.94),
}
BACKGROUND = (0.12, 0.12, 0.12)
SHAPES = ("circle", "square", "triangle", "cross")
PLURALS = {"circle": "circles", "square": "squares", "triangle": "triangles", "cross": "crosses"}
COUNT_WORDS = {1: "a", 2: "two", 3: "three"}
MAX_PROMPT_COUNT = max(COUNT_WORDS)
POSITION_PHRASES = {
    "left": ("on", "the", "left"),
    "right": ("on", "the", "right"),
    "top": ("at", "the", "top"),
    "bottom": ("at", "the", "bottom"),
    "center": ("in", "the", "center"),
}
POSITIONS = tuple(POSITION_PHRASES)
TEMPLATES = ("count", "position", "pair")
PAIRS: tuple[tuple[str, str], ...] = tuple(itertools.product(COLOURS, SHAPES))

SIZE_RANGE = (0.22, 0.34)  # object extent as a fraction of the image side (7-11 px at 32 px)
_GAP = 0.03  # minimum free space between two objects
# where a position scene puts its object's centre: (x_lo, x_hi, y_lo, y_hi), well inside the region
_POSITION_BOXES = {
    "left": (0.12, 0.30, 0.30, 0.70),
    "right": (0.70, 0.88, 0.30, 0.70),
    "top": (0.30, 0.70, 0.12, 0.30),
    "bottom": (0.30, 0.70, 0.70, 0.88),
    "center": (0.44, 0.56, 0.44, 0.56),
}
_HELDOUT_PAIR_COUNT = 4


class ShapeObject(NamedTuple):
    colour: str
    shape: str
    x: float  # centre, fraction of the width from the left
    y: float  # centre, fraction of the height from the top
    size: float  # extent, fraction of the image side


@dataclass(frozen=True)
class Scene:
    objects: tuple[ShapeObject, ...]
    position: str | None = None  # the region a single-object scene was composed to show


class Requirement(NamedTuple):
    colour: str
    shape: str
    count: int


@dataclass(frozen=True)
class PromptSpec:
    """What a prompt asks for: objects with their counts, and where the single object is."""

    requirements: tuple[Requirement, ...]
    position: str | None = None

    @property
    def template(self) -> str:
        if self.position is not None:
            return "position"
        return "pair" if len(self.requirements) == 2 else "count"


def vocabulary() -> list[str]:
    """Every word a prompt can contain, sorted (a tokenizer is built from this)."""
    words = {*COLOURS, *SHAPES, *PLURALS.values(), *COUNT_WORDS.values(), "and"}
    for phrase in POSITION_PHRASES.values():
        words.update(phrase)
    return sorted(words)


def in_position(x: float, y: float, position: str) -> bool:
    """Whether an object centred at (x, y) is in the named region."""
    if position not in POSITION_PHRASES:
        raise ValueError(f"unknown position {position!r}; choose one of {', '.join(POSITIONS)}")
    regions = {
        "left": x < 0.375,
        "right": x > 0.625,
        "top": y < 0.375,
        "bottom": y > 0.625,
        "center": abs(x - 0.5) < 0.125 and abs(y - 0.5) < 0.125,
    }
    return regions[position]


# ---------------------------------------------------------------------------------------------
# Prompts


def prompt_text(spec: PromptSpec) -> str:
    """The prompt that `parse_prompt` reads back as `spec`."""
    phrases = [
        f"{COUNT_WORDS[r.count]} {r.colour} {r.shape if r.count == 1 else PLURALS[r.shape]}"
        for r in spec.requirements
    ]
    text = " and ".join(phrases)
    if spec.position is not None:
        text += " " + " ".join(POSITION_PHRASES[spec.position])
    return text


@lru_cache(maxsize=8192)
def parse_prompt(text: str) -> PromptSpec:
    """What a prompt asks for; ValueError naming the unknown word or the broken rule otherwise."""
    words = text.lower().split()
    known = vocabulary()
    for word in words:
        if word not in known:
            raise ValueError(f"unknown word {word!r} in prompt {text!r}; known words: {', '.join(known)}")
    first, next_index = _parse_object(words, 0, text)
    if next_index == len(words):
        return PromptSpec((first,))
    if words[next_index] == "and":
        second, end = _parse_object(words, next_index + 1, text)
        if end != len(words):
            raise ValueError(f"prompt {text!r} goes on after its second object: {' '.join(words[end:])!r}")
        if first[:2] == second[:2]:
            raise ValueError(f"prompt {text!r} names {first.colour} {first.shape} twice; give one count")
        return PromptSpec((first, second))
    rest = tuple(words[next_index:])
    position = next((name for name, phrase in POSITION_PHRASES.items() if phrase == rest), None)
    if position is None:
        phrases = ", ".join(repr(" ".join(phrase)) for phrase in POSITION_PHRASES.values())
        raise ValueError(f"prompt {text!r}: expected 'and' or one of {phrases}, got {' '.join(rest)!r}")
    if first.count != 1:
        raise ValueError(f"prompt {text!r}: a position can only follow a single object ('a ...')")
    return PromptSpec((first,), position)


def _parse_object(words: list[str], start: int, text: str) -> tuple[Requirement, int]:
    """The object phrase at words[start:start + 3] (count, colour, shape) and the index after it."""
    if len(words) < start + 3:
        raise ValueError(f"prompt {text!r} ends early: an object is a count, a colour and a shape")
    count_word, colour, noun = words[start : start + 3]
    counts = {word: count for count, word in COUNT_WORDS.items()}
    if count_word not in counts:
        raise ValueError(f"prompt {text!r}: expected a count ({', '.join(counts)}), got {count_word!r}")
    if colour not in COLOURS:
        raise ValueError(f"prompt {text!r}: expected a colour ({', '.join(COLOURS)}), got {colour!r}")
    count = counts[count_word]
    nouns = {shape if count == 1 else PLURALS[shape]: shape for shape in SHAPES}
    if noun not in nouns:
        number = "singular" if count == 1 else "plural"
        raise ValueError(f"prompt {text!r}: after {count_word!r} expected a {number} shape, got {noun!r}")
    return Requirement(colour, nouns[noun], count), start + 3


def prompt_for(scene: Scene) -> str:
    """The prompt that describes a scene: its one or two kinds of object, with counts and position."""
    return prompt_text(spec_for(scene))


def spec_for(scene: Scene) -> PromptSpec:
    """What a scene shows, in the grammar's terms; ValueError for scenes the grammar cannot say."""
    counts: dict[tuple[str, str], int] = {}
    for obj in scene.objects:
        counts[obj.colour, obj.shape] = counts.get((obj.colour, obj.shape), 0) + 1
    if not 1 <= len(counts) <= 2 or max(counts.values()) > MAX_PROMPT_COUNT:
        raise ValueError(f"no prompt describes {len(scene.objects)} objects of {len(counts)} kinds")
    requirements = tuple(Requirement(colour, shape, n) for (colour, shape), n in counts.items())
    if scene.position is not None and len(scene.objects) != 1:
        raise ValueError(f"a position ({scene.position}) needs a single object, not {len(scene.objects)}")
    return PromptSpec(requirements, scene.position)


def all_prompts(pairs: Collection[tuple[str, str]] = PAIRS) -> list[str]:
    """Every prompt of the three templates about the given colour-shape pairs, in a fixed order."""
    pairs = [pair for pair in PAIRS if pair in set(pairs)]
    specs = [PromptSpec((Requirement(c, s, n),)) for c, s in pairs for n in COUNT_WORDS]
    specs += [PromptSpec((Requirement(c, s, 1),), position) for c, s in pairs for position in POSITIONS]
    specs += [
        PromptSpec((Requirement(*first, 1), Requirement(*second, 1)))
        for first, second in itertools.permutations(pairs, 2)
    ]
    return [prompt_text(spec) for spec in specs]


def heldout_pairs(seed: int = 0) -> list[tuple[str, str]]:
    """Colour-shape pairs kept out of training: 4 pairs of distinct colours and distinct shapes.

    Every colour and shape still appears in training with other partners, so prompts about a held-out
    pair test composition (a known colour on a known shape, never seen together), as GenEval does.
    """
    rng = np.random.default_rng(seed)
    colours = rng.permutation(list(COLOURS))[:_HELDOUT_PAIR_COUNT]
    shapes = rng.permutation(list(SHAPES))[:_HELDOUT_PAIR_COUNT]
    return sorted((str(c), str(s)) for c, s in zip(colours, shapes, strict=True))


def train_prompts(seed: int = 0) -> list[str]:
    """Prompts that mention no held-out pair of `heldout_pairs(seed)` (540 of 744)."""
    return all_prompts(_train_pairs(seed))


def heldout_prompts(seed: int = 0) -> list[str]:
    """Prompts that mention at least one held-out pair (204 of 744); disjoint from `train_prompts`."""
    seen = set(train_prompts(seed))
    return [prompt for prompt in all_prompts() if prompt not in seen]


def _train_pairs(seed: int) -> list[tuple[str, str]]:
    held_out = set(heldout_pairs(seed))
    return [pair for pair in PAIRS if pair not in held_out]


# ---------------------------------------------------------------------------------------------
# Scenes


def sample_spec(
    rng: np.random.Generator, template: str | None = None, pairs: Sequence[tuple[str, str]] = PAIRS
) -> PromptSpec:
    """A random prompt of a template (uniform over templates when None) about the given pairs."""
    template = template or str(rng.choice(TEMPLATES))
    if template not in TEMPLATES:
        raise ValueError(f"unknown template {template!r}; choose one of {', '.join(TEMPLATES)}")
    if template == "pair":
        first, second = rng.choice(len(pairs), size=2, replace=False)
        return PromptSpec((Requirement(*pairs[first], 1), Requirement(*pairs[second], 1)))
    colour, shape = pairs[rng.integers(len(pairs))]
    if template == "position":
        return PromptSpec((Requirement(colour, shape, 1),), str(rng.choice(POSITIONS)))
    return PromptSpec((Requirement(colour, shape, int(rng.integers(1, MAX_PROMPT_COUNT + 1))),))


def scene_for_spec(spec: PromptSpec, rng: np.random.Generator) -> Scene:
    """A random scene that shows exactly what the prompt asks for (and nothing else)."""
    kinds = [(r.colour, r.shape) for r in spec.requirements for _ in range(r.count)]
    box = _POSITION_BOXES[spec.position] if spec.position is not None else None
    return Scene(_place(kinds, rng, box), spec.position)


RandomSource = np.random.Generator | torch.Generator | int


def numpy_rng(source: RandomSource) -> np.random.Generator:
    """A numpy Generator: the one given, one seeded with an int, or one seeded by a torch Generator."""
    if isinstance(source, torch.Generator):
        source = int(torch.randint(2**62, (1,), generator=source))
    return np.random.default_rng(source)


def sample_scene(
    rng: RandomSource, template: str | None = None, pairs: Sequence[tuple[str, str]] = PAIRS
) -> Scene:
    """A random scene that one prompt of the grammar describes (see `prompt_for`)."""
    rng = numpy_rng(rng)
    return scene_for_spec(sample_spec(rng, template, pairs), rng)


def sample_cluttered_scene(rng: RandomSource, max_objects: int = 5) -> Scene:
    """1..max_objects objects of 1-4 random kinds, often repeated: varied counts for the scorer.

    Most of these scenes have no prompt; they teach the alignment scorer to count and locate every
    kind of object among distractors.
    """
    rng = numpy_rng(rng)
    n_objects = int(rng.integers(1, max_objects + 1))
    n_kinds = int(rng.integers(1, min(n_objects, 4) + 1))
    kinds = [PAIRS[i] for i in rng.choice(len(PAIRS), size=n_kinds, replace=False)]
    extra = [kinds[i] for i in rng.integers(n_kinds, size=n_objects - n_kinds)]
    return Scene(_place(kinds + extra, rng))


def _place(
    kinds: list[tuple[str, str]],
    rng: np.random.Generator,
    box: tuple[float, float, float, float] | None = None,
) -> tuple[ShapeObject, ...]:
    """Objects of the given kinds at random sizes and places, inside the image and not touching."""
    while True:  # start afresh when the objects placed so far leave no room for the next one
        placed: list[ShapeObject] = []
        for colour, shape in kinds:
            size = float(rng.uniform(*SIZE_RANGE))
            radius = size / 2
            x_lo, x_hi, y_lo, y_hi = box or (0.0, 1.0, 0.0, 1.0)
            x_lo, y_lo = max(x_lo, radius + 0.01), max(y_lo, radius + 0.01)
            x_hi, y_hi = min(x_hi, 1 - radius - 0.01), min(y_hi, 1 - radius - 0.01)
            for _ in range(50):
                x, y = float(rng.uniform(x_lo, x_hi)), float(rng.uniform(y_lo, y_hi))
                if all(math.hypot(x - o.x, y - o.y) > radius + o.size / 2 + _GAP for o in placed):
                    placed.append(ShapeObject(colour, shape, x, y, size))
                    break
            else:
                break
        if len(placed) == len(kinds):
            return tuple(placed)


# ---------------------------------------------------------------------------------------------
# Rendering and data sets


def render(scene: Scene, size: int = 32) -> Tensor:
    """The scene as a float32 image [3, size, size] in [0, 1] (hard-edged masks, no anti-aliasing)."""
    xs, ys = _pixel_centres(size)
    image = np.empty((size, size, 3), dtype=np.float32)
    image[:] = BACKGROUND
    for obj in scene.objects:
        image[_shape_mask(obj.shape, xs - obj.x, ys - obj.y, obj.size / 2)] = COLOURS[obj.colour]
    return torch.from_numpy(image).permute(2, 0, 1).contiguous()


def render_batch(scenes: Sequence[Scene], size: int = 32) -> Tensor:
    """Scenes as one float32 batch [n, 3, size, size]."""
    return torch.stack([render(scene, size) for scene in scenes])


@cache
def _pixel_centres(size: int) -> tuple[np.ndarray, np.ndarray]:
    centres = (np.arange(size, dtype=np.float32) + 0.5) / size
    return centres[None, :], centres[:, None]


def _shape_mask(shape: str, dx: np.ndarray, dy: np.ndarray, radius: float) -> np.ndarray:
    """Pixels inside a shape of half-extent `radius`, from their offsets to its centre."""
    if shape == "circle":
        return dx**2 + dy**2 <= radius**2
    if shape == "square":  # a little smaller than its circle so that both cover similar areas
        return (np.abs(dx) <= 0.85 * radius) & (np.abs(dy) <= 0.85 * radius)
    if shape == "triangle":  # pointing up, apex at the top, base as wide as the object
        depth = (dy + radius) / (1.8 * radius)
        return (dy >= -radius) & (dy <= 0.8 * radius) & (np.abs(dx) <= depth * radius)
    if shape == "cross":  # an upright plus sign
        arm = 0.36 * radius
        return ((np.abs(dx) <= arm) & (np.abs(dy) <= radius)) | ((np.abs(dy) <= arm) & (np.abs(dx) <= radius))
    raise ValueError(f"unknown shape {shape!r}; choose one of {', '.join(SHAPES)}")


def make_dataset(
    n: int, seed: int, size: int = 32, split: str = "train", split_seed: int = 0
) -> tuple[Tensor, list[str], list[PromptSpec]]:
    """n (image, prompt) examples, the same for the same arguments; templates equally likely.

    split "train" uses only the pairs of `train_prompts(split_seed)` (so that held-out prompts stay
    unseen compositions when a model is pretrained on this), "heldout" only prompts that mention a
    held-out pair, "all" everything.
    """
    rng = np.random.default_rng(seed)
    held_out = set(heldout_pairs(split_seed))
    pairs = {"train": _train_pairs(split_seed), "heldout": list(PAIRS), "all": list(PAIRS)}.get(split)
    if pairs is None:
        raise ValueError(f"unknown split {split!r}; choose one of train, heldout, all")
    specs: list[PromptSpec] = []
    for _ in range(n):
        template = str(rng.choice(TEMPLATES))
        spec = sample_spec(rng, template, pairs)
        while split == "heldout" and not any(r[:2] in held_out for r in spec.requirements):
            spec = sample_spec(rng, template, pairs)
        specs.append(spec)
    scenes = [scene_for_spec(spec, rng) for spec in specs]
    return render_batch(scenes, size), [prompt_text(spec) for spec in specs], specs
