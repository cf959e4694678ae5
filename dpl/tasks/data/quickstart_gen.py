"""Generator of dpl's quickstart data: short, synthetic movie and product reviews labelled ``negative`` or
``positive``.

Every sentence comes from the templates and word lists below (nothing is copied from an existing data set).
The label follows from the sentence by fixed rules. About 40% of the sentences are plain statements
("the plot was dull"); the rest need more than single words:

* negations flip an adjective ("was not good" is negative, "was not bad" is positive),
* in contrasts the main clause wins ("the acting was great, but the plot was dull" is negative;
  "although the plot was dull, the acting was great" is positive),
* expectations, "the only good thing about ...", "could have been ...", "my friends loved it, but I ...",
  rhetorical questions and comparisons need the whole sentence; "not only ... but also" and idioms such as
  "I can't recommend it enough" use negation words without negating, and neutral filler carries no signal.

Classes are exactly balanced before noise; then 3% of each split's labels are flipped (equally many of each
class), so no model reaches 100%. The output is a deterministic function of the seed and the split sizes:
:class:`~dpl.tasks.data.quickstart.QuickstartDataModule` generates its rows in memory with :func:`generate`, and
``scripts/make_quickstart_data.py`` writes them as TSV.
"""

from __future__ import annotations

import random
from collections.abc import Callable

SEED = 20240611
TRAIN_SIZE = 2000
VALIDATION_SIZE = 400
NOISE = 0.03

POS, NEG = 1, 0
LABELS = {POS: "positive", NEG: "negative"}

DOMAINS = {
    "movie": {
        "subjects": ["the movie", "the film", "this film", "the plot", "the acting", "the script", "the ending",
                     "the dialogue", "the soundtrack", "the cast", "the sequel", "the story", "the lead actor",
                     "the camera work", "the second half", "the opening scene", "this documentary", "the pacing",
                     "the villain", "the special effects", "the screenplay", "this comedy", "the animation"],
        "nouns": ["movie", "film", "story", "comedy", "thriller", "sequel", "documentary", "drama", "cartoon"],
        POS: ["gripping", "moving", "hilarious", "beautifully shot", "clever", "touching", "thrilling",
              "heartfelt", "well acted", "memorable", "funny", "stunning", "engaging", "fresh"],
        NEG: ["boring", "dull", "predictable", "tedious", "clumsy", "forgettable", "shallow", "confusing",
              "painfully slow", "wooden", "lifeless", "overlong", "silly", "flat"],
        "fillers": ["I watched it on a Friday night.", "We saw it at the downtown theater.",
                    "It runs a little over two hours.", "My cousin told me about it.",
                    "I streamed it last weekend.", "It came out in the spring.", "We watched it after dinner.",
                    "The director also made a western.", "I saw the late showing.",
                    "It is based on a novel.", "There is a sequel planned."],
        "better_than": ["the first one", "the trailer suggested", "the book", "I expected", "last year's version"],
        "extras": ["the popcorn", "the trailer", "the poster", "the theme song", "the costumes", "the title"],
        "seen": ["watching", "seeing"],
    },
    "product": {
        "subjects": ["the blender", "this kettle", "the headphones", "the battery", "the charger", "this jacket",
                     "the keyboard", "the laptop", "the vacuum", "these shoes", "the backpack", "this lamp",
                     "the phone case", "the coffee maker", "the mattress", "the camera", "this desk chair",
                     "the speaker", "the water bottle", "the toaster", "the umbrella", "the printer", "the mouse"],
        "nouns": ["blender", "kettle", "jacket", "keyboard", "lamp", "backpack", "speaker", "toaster", "chair",
                  "printer", "camera", "mattress"],
        POS: ["sturdy", "reliable", "comfortable", "well made", "easy to use", "worth the money", "quiet",
              "durable", "handy", "solid", "well designed", "practical", "a great value", "dependable"],
        NEG: ["flimsy", "unreliable", "uncomfortable", "cheaply made", "hard to use", "overpriced", "noisy",
              "fragile", "useless", "defective", "poorly designed", "awkward", "a waste of money", "broken"],
        "fillers": ["It came in a brown box.", "I bought it in March.", "I ordered the blue one.",
                    "I use it mostly on weekends.", "My sister has the older model.", "It was a birthday gift.",
                    "I got it from the store near my office.", "It ships with a manual.", "I have had it a month.",
                    "The box says it was made last year.", "I picked the large size."],
        "better_than": ["my old one", "the previous model", "the reviews suggested", "I expected",
                        "the one my neighbor has"],
        "extras": ["the color", "the box", "the logo", "the manual", "the price tag", "the cable"],
        "seen": ["using"],
    },
}
GENERIC = {POS: ["great", "excellent", "wonderful", "fantastic", "superb", "delightful", "good", "impressive",
                 "enjoyable", "brilliant", "lovely", "amazing", "terrific", "pleasant"],
           NEG: ["terrible", "awful", "disappointing", "bad", "poor", "mediocre", "dreadful", "horrible",
                 "frustrating", "lousy", "annoying", "weak", "underwhelming", "sloppy"]}
INTENSIFIERS = ["", "", "", "", "very ", "really ", "truly ", "incredibly ", "absolutely ", "quite ", "pretty ",
                "so ", "extremely ", "remarkably ", "genuinely "]
SOFTENERS = ["a bit ", "rather ", "somewhat ", "a little "]  # only before negative adjectives
NEGATIONS = ["was not", "is not", "wasn't", "isn't", "was not at all", "was never", "was hardly", "was far from",
             "was anything but", "was not really", "is by no means", "did not feel", "did not seem", "never felt",
             "is not exactly", "was not very"]
VERBS = ["was", "is", "felt", "seemed", "turned out to be", "looks", "was just", "ended up being", "proved"]
PLURAL_SUBJECTS = {"the headphones", "these shoes", "the special effects"}
PLURAL_VERBS = {"was": "were", "is": "are", "wasn't": "weren't", "isn't": "aren't", "looks": "look"}
OPENERS = ["", "", "", "", "Honestly, ", "Overall, ", "To be fair, ", "In my opinion, ", "Well, ", "Frankly, ",
           "I have to say ", "After a week, ", "For what it is worth, ", "All in all, ", "Simply put, "]
LIKE = {POS: ["loved", "really enjoyed", "adored", "was impressed by", "had a great time with", "liked",
              "was delighted with", "can't stop recommending"],
        NEG: ["hated", "was let down by", "could not stand", "regret paying for", "was annoyed by", "disliked",
              "was bored by", "gave up on"]}
NOT_LIKE = {NEG: ["did not enjoy", "did not like", "can't say I enjoyed", "never warmed to", "was not impressed by"],
            POS: ["did not regret buying", "never got bored of", "could not find a flaw in",
                  "have no complaints about", "was not disappointed by"]}
RECOMMEND = {POS: ["Would recommend.", "Would buy again.", "Highly recommended.", "I would happily do it again.",
                   "I'd recommend it to anyone.", "Worth every penny."],
             NEG: ["Would not recommend.", "Would not buy again.", "Not recommended.", "Never again.",
                   "I want my money back.", "Skip this one."]}
OTHERS = ["My friends", "The critics", "My brother", "Everyone at work", "My kids", "The reviews", "My neighbor"]
IDIOMS = {POS: ["I can't recommend {s} enough.", "I could not stop {seen} {s}.", "{s} never gets old.",
                "No regrets about {s}.", "I have zero complaints about {s}.", "{s} did not disappoint.",
                "There is nothing I would change about {s}."],
          NEG: ["{s} is just not for me.", "I would not wish {s} on anyone.", "{s} left a lot to be desired.",
                "{s} is not worth a second look.", "I can't believe I spent money on {s}.",
                "{s} was a total letdown.", "There is nothing I liked about {s}."]}
PREDICATE_ONLY = ("a ", "worth ", "easy to", "hard to")  # read oddly before a noun or after "very"
STARS = {POS: ["Five stars.", "Four stars.", "5 out of 5.", "4 out of 5.", "Ten out of ten."],
         NEG: ["One star.", "Two stars.", "1 out of 5.", "2 out of 5.", "Zero stars if I could."]}


class Generator:
    simple_weight = 8.0  # weight of plain statements among the templates

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def pick(self, items: list[str]) -> str:
        return self.rng.choice(items)

    def adjective(self, domain: dict, polarity: int, attributive: bool = False) -> str:
        while True:
            adj = self.pick(domain[polarity] if self.rng.random() < 0.6 else GENERIC[polarity])
            if not attributive or not adj.startswith(PREDICATE_ONLY):
                return adj

    def intensified(self, domain: dict, polarity: int, attributive: bool = False) -> str:
        adj = self.adjective(domain, polarity, attributive)
        if adj.startswith(PREDICATE_ONLY):
            return adj
        pool = INTENSIFIERS + SOFTENERS if polarity == NEG and not attributive else INTENSIFIERS
        return self.pick(pool) + adj

    def clause(self, domain: dict, polarity: int, subject: str | None = None, intensify: bool = True) -> str:
        subject = subject or self.pick(domain["subjects"])
        adj = self.intensified(domain, polarity) if intensify else self.adjective(domain, polarity)
        return f"{subject} {_agree(subject, self.pick(VERBS))} {adj}"

    # Each template returns a sentence whose (noise-free) label is y.

    def simple(self, d: dict, y: int) -> str:
        return f"{self.pick(OPENERS)}{self.clause(d, y)}."

    def negated(self, d: dict, y: int) -> str:
        subject = self.pick(d["subjects"])
        verb = _agree(subject, self.pick(NEGATIONS))
        return f"{self.pick(OPENERS)}{subject} {verb} {self.adjective(d, 1 - y)}."

    def contrast(self, d: dict, y: int) -> str:
        a, b = self.rng.sample(d["subjects"], 2)
        first = 1 - y if self.rng.random() < 0.85 else y
        link = self.pick([", but ", ", but ", ", however ", ", yet ", "; still, "])
        return f"{self.clause(d, first, a, intensify=False)}{link}{self.clause(d, y, b)}."

    def although(self, d: dict, y: int) -> str:
        a, b = self.rng.sample(d["subjects"], 2)
        conj = self.pick(["Although", "Even though", "While", "Though"])
        if self.rng.random() < 0.5:
            return f"{conj} {self.clause(d, 1 - y, a, intensify=False)}, {self.clause(d, y, b)}."
        return f"{self.clause(d, y, b)}, even though {self.clause(d, 1 - y, a, intensify=False)}."

    def like(self, d: dict, y: int) -> str:
        subject = self.pick(d["subjects"])
        if self.rng.random() < 0.35:
            return f"{self.pick(OPENERS)}I {self.pick(NOT_LIKE[y])} {subject}."
        return f"{self.pick(OPENERS)}I {self.pick(LIKE[y])} {subject}."

    def expectation(self, d: dict, y: int) -> str:
        subject = self.pick(d["subjects"])
        it = "they were" if subject in PLURAL_SUBJECTS else "it was"
        if self.rng.random() < 0.4:
            return f"I expected {subject} to be {self.adjective(d, y)}, and {it}."
        return f"I expected {subject} to be {self.adjective(d, 1 - y)}, but {it} {self.intensified(d, y)}."

    def could_have_been(self, d: dict, y: int) -> str:
        subject = self.pick(d["subjects"])
        if y == NEG:
            end = self.pick(["but it was not", "but it wasn't", "but it just isn't", "if only it tried"])
            if subject in PLURAL_SUBJECTS:
                end = end.replace("it was", "they were").replace("it wasn't", "they weren't").replace(
                    "it just isn't", "they just aren't").replace("it tried", "they tried")
            return f"{subject} could have been {self.adjective(d, POS)}, {end}."
        return f"I thought {subject} would be {self.adjective(d, NEG)}, but it turned out {self.adjective(d, POS)}."

    def only_thing(self, d: dict, y: int) -> str:
        subject = self.pick(d["subjects"])
        extra = self.pick(d["extras"])
        word = "bad" if y == POS else "good"
        return f"The only {word} thing about {subject} was {extra}."

    def comparison(self, d: dict, y: int) -> str:
        subject = self.pick(d["subjects"])
        word = {POS: ["better", "more fun", "nicer"], NEG: ["worse", "less fun", "weaker"]}[y]
        how = self.pick(["", "much ", "far ", "a lot ", "slightly "])
        opener, verb = self.pick(OPENERS), _agree(subject, "is")
        comparative, other = self.pick(word), self.pick(d["better_than"])
        return f"{opener}{subject} {verb} {how}{comparative} than {other}."

    def nothing(self, d: dict, y: int) -> str:
        subject = self.pick(d["subjects"])
        if self.rng.random() < 0.5:
            return f"Nothing about {subject} was {self.adjective(d, 1 - y)}."
        adj = self.adjective(d, 1 - y, attributive=True)
        return f"There was not a single {adj} moment {self.pick(d['seen'])} {subject}."

    def exclamation(self, d: dict, y: int) -> str:
        noun = self.pick(d["nouns"])
        if self.rng.random() < 0.3:  # "Not a clever film at all." flips the adjective
            adj = self.adjective(d, 1 - y, attributive=True)
            return f"Not {_article(adj)} {adj} {noun} at all."
        adj = self.intensified(d, y, attributive=True)
        return f"What {_article(adj)} {adj} {noun}!"

    def others(self, d: dict, y: int) -> str:
        subject = self.pick(d["subjects"])
        who = self.pick(OTHERS)
        if self.rng.random() < 0.5:
            return f"{who} {self.pick(LIKE[1 - y])} {subject}, but I {self.pick(LIKE[y])} it."
        return (f"{who} said {subject} was {self.adjective(d, 1 - y)}, but I found it "
                f"{self.intensified(d, y)}.")

    def wanted(self, d: dict, y: int) -> str:
        subject = self.pick(d["subjects"])
        if y == NEG:
            return self.pick([f"I wanted to like {subject}, but {self.clause(d, NEG, 'it')}.",
                              f"I really wanted to love {subject}, but it just did not work.",
                              f"I had high hopes for {subject}, and it let me down."])
        return self.pick([f"I was ready to hate {subject}, but it won me over.",
                          f"I did not expect much from {subject}, but it was {self.intensified(d, POS)}.",
                          f"I had low hopes for {subject}, and it surprised me."])

    def question(self, d: dict, y: int) -> str:
        subject = self.pick(d["subjects"])
        return f"{self.pick(['Who could call', 'How can anyone call', 'Why do people call'])} {subject} " \
               f"{self.adjective(d, 1 - y)}?"

    def not_only(self, d: dict, y: int) -> str:  # "not" that does not negate
        subject = self.pick(d["subjects"])
        a, b = self.rng.sample(d[y] + GENERIC[y], 2)
        return f"{subject} {_agree(subject, self.pick(['was', 'is']))} not only {a} but also {b}."

    def idiom(self, d: dict, y: int) -> str:
        subject = self.pick(d["subjects"])
        return _cap(self.pick(IDIOMS[y]).format(s=subject, seen=self.pick(d["seen"])))

    def verdict(self, d: dict, y: int) -> str:
        first = self.pick(d["fillers"]) if self.rng.random() < 0.6 else f"{self.clause(d, y).capitalize()}."
        last = self.pick(RECOMMEND[y] if self.rng.random() < 0.7 else STARS[y])
        return f"{first} {last}"

    def sentence(self, y: int) -> str:
        return self.draw(y)[1]

    def draw(self, y: int) -> tuple[str, str]:
        """A sentence of (noise-free) label ``y`` and the name of the template it came from."""
        domain = DOMAINS[self.pick(list(DOMAINS))]
        templates: list[tuple[Callable[[dict, int], str], float]] = [
            (self.simple, self.simple_weight), (self.negated, 2.0), (self.contrast, 2.0), (self.although, 1.2),
            (self.like, 1.2), (self.expectation, 1.0), (self.could_have_been, 0.8), (self.only_thing, 0.6),
            (self.comparison, 0.8), (self.nothing, 0.6), (self.exclamation, 2.0), (self.verdict, 2.0),
            (self.others, 1.0), (self.wanted, 0.8), (self.question, 0.5), (self.not_only, 0.7), (self.idiom, 0.8)]
        fns, weights = zip(*templates)
        template = self.rng.choices(fns, weights=weights)[0]
        text = template(domain, y)
        if self.rng.random() < 0.2:  # neutral filler before or after
            filler = self.pick(domain["fillers"])
            text = f"{filler} {_cap(text)}" if self.rng.random() < 0.5 else f"{_cap(text)} {filler}"
        text = _cap(" ".join(text.split()))
        if self.rng.random() < 0.08:
            text = text.lower()
        return template.__name__, text

    def draw_new(self, y: int, seen: set[str]) -> tuple[str, str, list[str]]:
        """:meth:`draw` until the sentence is not in ``seen`` (lower case), which it then joins; also returns the
        rejected sentences."""
        rejected = []
        while True:
            template, text = self.draw(y)
            if text.lower() not in seen:
                seen.add(text.lower())
                return template, text, rejected
            rejected.append(text.lower())


def _agree(subject: str, verb: str) -> str:
    if subject not in PLURAL_SUBJECTS:
        return verb
    first, _, rest = verb.partition(" ")
    return " ".join([PLURAL_VERBS.get(first, first)] + ([rest] if rest else []))


def _article(phrase: str) -> str:
    return "an" if phrase[:1] in "aeiou" and not phrase.startswith(("use", "uni", "eu")) else "a"


def _cap(text: str) -> str:
    return text[:1].upper() + text[1:]


def generate(seed: int = SEED, train_size: int = TRAIN_SIZE, validation_size: int = VALIDATION_SIZE,
             noise: float = NOISE, simple_weight: float = Generator.simple_weight,
             stats: dict[str, int] | None = None) -> dict[str, list[tuple[str, str]]]:
    """Both splits as lists of (sentence, label); unique sentences (compared in lower case), none shared
    between the splits: a drawn sentence already used is drawn again. ``stats``, if given, receives per split
    the number of redrawn sentences (``<split>_redrawn``) and of those that duplicated a training sentence
    (``validation_in_train``): the overlap the generator produces by chance."""
    gen = Generator(seed)
    gen.simple_weight = simple_weight
    seen: set[str] = set()
    train: set[str] = set()
    stats = {} if stats is None else stats
    splits = {}
    for name, size in (("train", train_size), ("validation", validation_size)):
        rows: list[tuple[str, int]] = []
        redrawn = in_train = 0
        for i in range(size):
            y = POS if i % 2 == 0 else NEG
            _, text, rejected = gen.draw_new(y, seen)
            redrawn += len(rejected)
            in_train += sum(r in train for r in rejected)
            rows.append((text, y))
        if name == "train":
            train = set(seen)
        else:
            stats["validation_in_train"] = in_train
        stats[f"{name}_redrawn"] = redrawn
        gen.rng.shuffle(rows)
        flips = round(size * noise / 2)  # as many of each class, so the balance stays exact
        flipped = {i for y in (POS, NEG) for i in gen.rng.sample([i for i, r in enumerate(rows) if r[1] == y], flips)}
        splits[name] = [(text, LABELS[1 - y if i in flipped else y]) for i, (text, y) in enumerate(rows)]
    return splits


def by_template(seed: int, size: int, exclude: set[str] | None = None) -> list[tuple[str, str, str]]:
    """``size`` fresh (sentence, label, template name) rows, classes alternating, labels noise-free (no flips):
    what a per-template evaluation needs. Sentences in ``exclude`` (compared in lower case, e.g. the training
    sentences) and repeats are drawn again."""
    gen = Generator(seed)
    seen = {s.lower() for s in exclude or ()}
    rows = []
    for i in range(size):
        y = POS if i % 2 == 0 else NEG
        template, text, _ = gen.draw_new(y, seen)
        rows.append((text, LABELS[y], template))
    return rows
