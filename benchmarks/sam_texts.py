"""Text families for ``bench_sam.py``'s comparison with vLLM's ``suffix`` method, generated here.

Every text is made by the code below from a fixed seed (nothing is downloaded, nothing is
copied): word lists and sentence frames written for this benchmark, filled with computed
numbers and generated names. Each family stands for a kind of RL rollout whose repetition
differs from the standard library's source code (the benchmark's first family):

* ``math``: worked solutions of arithmetic problems (modular powers by repeated squaring,
  Euclid's algorithm with back-substitution, factorization by trial division, long
  division, sums of series), each template many instances: the frames recur across prompts,
  the numbers do not. A prompt's samples (GRPO siblings) solve the same problem with
  different phrasing, an extra check here and there, and now and then a slip that is
  noticed and corrected.
* ``docs``: reference pages of one generated library: each prompt asks for the pages of a
  subset of its functions and every page opens with the library's conventions. Prompts'
  subsets overlap, so groups of *different* prompts share large parts of their answers (a
  function's page is written the same way, up to phrasing, wherever it appears): the family
  where text recurs across prompts.
* ``edits``: edits of generated Python modules: the prompt holds a module and asks for one
  change, the answer is the whole module with the change made; several prompts edit the
  same module (different changes), so their answers share most of their text, and that
  text is also in each prompt.

``family(name)`` returns the prompts and answers as strings; the benchmark tokenizes them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass
class TextFamily:
    """``groups``: (prompt, the prompt's answers: its GRPO siblings); ``independent``: (prompt,
    answer) pairs of distinct prompts."""

    name: str
    title: str
    groups: list = field(default_factory=list)
    independent: list = field(default_factory=list)

    def corpus(self) -> list[str]:
        """Every text, for training the family's tokenizer."""
        out = []
        for prompt, answers in self.groups:
            out.append(prompt)
            out.extend(answers)
        for prompt, answer in self.independent:
            out.extend((prompt, answer))
        return out


def _pick(rng: random.Random, options):
    return options[rng.randrange(len(options))]


class _Voice:
    """Phrasing of one sample: a sentence frame is chosen by the sample's own generator, so
    siblings (same problem, different samples) phrase the same steps differently, while a
    sample keeps some habits (``habit``: frames it prefers)."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.habit = self.rng.random()

    def say(self, *frames: str, **values) -> str:
        r = self.rng.random()
        i = 0 if r < 0.45 + 0.3 * self.habit else self.rng.randrange(len(frames))
        return frames[i].format(**values)

    def maybe(self, p: float) -> bool:
        return self.rng.random() < p


# -- math: worked solutions -----------------------------------------------------------------------

def _modpow(v: _Voice, a: int, e: int, m: int) -> list[str]:
    out = [v.say("We need {a}^{e} mod {m}.", "The task is to compute {a} to the power {e} modulo {m}.",
                 "Let us find the remainder of {a}^{e} when divided by {m}.", a=a, e=e, m=m)]
    bits = bin(e)[2:]
    out.append(v.say("First write the exponent in binary: {e} = {b} in base 2.",
                     "In binary, {e} is {b}.", "The exponent {e} has binary expansion {b}.", e=e, b=bits))
    out.append(v.say("Now square repeatedly, reducing modulo {m} at each step.",
                     "Next I compute the repeated squares of {a} modulo {m}.", a=a, m=m))
    sq, powers = a % m, []
    for i in range(len(bits)):
        powers.append(sq)
        if i == 0:
            out.append(v.say("{a}^1 = {s} (mod {m}).", "{a}^1 is {s} mod {m}.", a=a, s=sq, m=m))
        else:
            prev = powers[i - 1]
            full = prev * prev
            out.append(v.say("{a}^{p} = {q}^2 = {f} = {s} (mod {m}).",
                             "{a}^{p} = ({q})^2 = {f}, which is {s} mod {m}.",
                             "Squaring {q} gives {f}, so {a}^{p} = {s} (mod {m}).",
                             a=a, p=1 << i, q=prev, f=full, s=sq, m=m))
        sq = sq * sq % m
    used = [1 << i for i, b in enumerate(reversed(bits)) if b == "1"]
    out.append(v.say("The exponent is {parts}.", "So {e} = {parts}.", "Hence {e} splits as {parts}.",
                     e=e, parts=" + ".join(map(str, used))))
    acc = 1
    for p in used:
        i = p.bit_length() - 1
        nxt = acc * powers[i] % m
        out.append(v.say("Multiply by {a}^{p}: {acc} * {w} = {f} = {n} (mod {m}).",
                         "Times {a}^{p}: {acc} x {w} = {f}, reduced {n}.",
                         "Including {a}^{p} gives {acc} * {w} = {f}, that is {n} modulo {m}.",
                         a=a, p=p, acc=acc, w=powers[i], f=acc * powers[i], n=nxt, m=m))
        acc = nxt
    if v.maybe(0.5):
        out.append(v.say("Let me double-check the last squares.", "Checking the squares again:",
                         "A quick check of the table:"))
        for i in range(max(1, len(powers) - 3), len(powers)):
            out.append(v.say("{q}^2 = {f}, and {f} mod {m} = {s}. Correct.",
                             "{q} squared is {f}; modulo {m} that is {s}, as before.",
                             q=powers[i - 1], f=powers[i - 1] ** 2, m=m, s=powers[i]))
    out.append(v.say("Therefore {a}^{e} mod {m} = {r}.", "So the answer is {r}.",
                     "The remainder is {r}.", a=a, e=e, m=m, r=acc))
    return out


def _euclid(v: _Voice, a: int, b: int) -> list[str]:
    out = [v.say("We want gcd({a}, {b}) and integers x, y with {a}x + {b}y = gcd({a}, {b}).",
                 "Find the greatest common divisor of {a} and {b}, and write it as a combination of them.",
                 a=a, b=b)]
    out.append(v.say("Apply the Euclidean algorithm.", "Run Euclid's algorithm:",
                     "I will use repeated division with remainder."))
    x, y, rows = a, b, []
    while y:
        q, r = divmod(x, y)
        rows.append((x, y, q, r))
        out.append(v.say("{x} = {q} * {y} + {r}", "{x} = {y} * {q} + {r}", "Divide {x} by {y}: quotient {q}, remainder {r}.",
                         x=x, y=y, q=q, r=r))
        x, y = y, r
    g = x
    out.append(v.say("The last nonzero remainder is {g}, so gcd({a}, {b}) = {g}.",
                     "So gcd({a}, {b}) = {g}.", g=g, a=a, b=b))
    out.append(v.say("Now back-substitute.", "Working backwards through the divisions:",
                     "Next, express {g} through {a} and {b} step by step.", g=g, a=a, b=b))
    s0, t0, s1, t1 = 1, 0, 0, 1
    for x_, y_, q, r in rows[:-1]:
        s0, s1 = s1, s0 - q * s1
        t0, t1 = t1, t0 - q * t1
        out.append(v.say("{r} = {s} * {a} + {t} * {b}", "{r} = ({s}) * {a} + ({t}) * {b}",
                         "so {r} equals {s}*{a} + {t}*{b}", r=r, s=s1, t=t1, a=a, b=b))
    if len(rows) == 1:
        s1, t1 = 0, 1
    if v.maybe(0.6):
        out.append(v.say("Check: {s} * {a} + {t} * {b} = {p} + {q} = {g}. Correct.",
                         "Verify: {s}*{a} = {p} and {t}*{b} = {q}, which add up to {g}.",
                         s=s1, a=a, t=t1, b=b, p=s1 * a, q=t1 * b, g=s1 * a + t1 * b))
    out.append(v.say("Answer: gcd = {g}, x = {s}, y = {t}.", "So gcd({a}, {b}) = {g} with x = {s} and y = {t}.",
                     g=g, a=a, b=b, s=s1, t=t1))
    return out


def _primes(limit: int) -> list[int]:
    sieve = bytearray([1]) * (limit + 1)
    sieve[:2] = b"\x00\x00"
    for i in range(2, int(limit ** 0.5) + 1):
        if sieve[i]:
            sieve[i * i::i] = bytearray(len(sieve[i * i::i]))
    return [i for i in range(limit + 1) if sieve[i]]


def _factor(v: _Voice, n: int) -> list[str]:
    out = [v.say("Factor {n} into primes.", "We need the prime factorization of {n}.",
                 "Let us find all prime factors of {n}.", n=n)]
    out.append(v.say("Try the primes in increasing order.", "I will test divisibility by each prime in turn.",
                     "Trial division, starting from 2:"))
    m, factors = n, []
    for p in _primes(2000):
        if p * p > m:
            break
        if m % p:
            out.append(v.say("{m} / {p} = {q} remainder {r}: not divisible by {p}.",
                             "{p} does not divide {m} (remainder {r}).",
                             "Dividing {m} by {p} leaves {r}, so {p} is not a factor.",
                             m=m, p=p, q=m // p, r=m % p))
            continue
        while m % p == 0:
            out.append(v.say("{m} / {p} = {q}: {p} is a factor.", "{p} divides {m}: {m} = {p} * {q}.",
                             "{m} is divisible by {p}, giving {q}.", m=m, p=p, q=m // p))
            factors.append(p)
            m //= p
    if m > 1:
        out.append(v.say("{m} has no prime factor up to its square root, so it is prime.",
                         "The remaining {m} is prime.", m=m))
        factors.append(m)
    out.append(v.say("So {n} = {f}.", "The factorization is {n} = {f}.", n=n, f=" * ".join(map(str, factors))))
    if v.maybe(0.5):
        prod = 1
        for f in factors:
            prod *= f
            out.append(v.say("Running product: {p}.", "Multiply back: {p}.", p=prod))
        out.append(v.say("The product is {n} again. Correct.", "That gives back {n}.", n=n))
    return out


def _long_division(v: _Voice, a: int, b: int, digits: int) -> list[str]:
    out = [v.say("Compute {a} / {b} to {d} decimal places.", "We divide {a} by {b}, to {d} digits after the point.",
                 a=a, b=b, d=digits)]
    q, r = divmod(a, b)
    out.append(v.say("{b} goes into {a} {q} times, remainder {r}.", "The integer part is {q} with remainder {r}.",
                     a=a, b=b, q=q, r=r))
    ds = []
    for _ in range(digits):
        r10 = r * 10
        d, r = divmod(r10, b)
        ds.append(str(d))
        out.append(v.say("Bring down a zero: {x} / {b} = {d}, remainder {r}.",
                         "{x} divided by {b} is {d} with {r} left.", "Next digit: {x} = {d} * {b} + {r}.",
                         x=r10, b=b, d=d, r=r))
    out.append(v.say("So {a} / {b} = {q}.{ds}...", "The quotient is {q}.{ds} (to {n} places).",
                     a=a, b=b, q=q, ds="".join(ds), n=digits))
    return out


def _series(v: _Voice, a0: int, d: int, n: int) -> list[str]:
    out = [v.say("Find the sum of the first {n} terms of the arithmetic sequence {a0}, {a1}, {a2}, ...",
                 "Sum the arithmetic progression starting at {a0} with difference {d}, {n} terms.",
                 n=n, a0=a0, a1=a0 + d, a2=a0 + 2 * d, d=d)]
    total = 0
    for i in range(n):
        term = a0 + i * d
        total += term
        out.append(v.say("Term {i}: {t}, running sum {s}.", "Add {t} (term {i}): the sum is now {s}.",
                         "a_{i} = {t}; partial sum S_{i} = {s}.", i=i + 1, t=term, s=total))
    last = a0 + (n - 1) * d
    out.append(v.say("Check with the formula: n(a_1 + a_n)/2 = {n}({a0} + {last})/2 = {s}.",
                     "The formula gives {n} * ({a0} + {last}) / 2 = {s}, matching.",
                     n=n, a0=a0, last=last, s=n * (a0 + last) // 2))
    out.append(v.say("The sum is {s}.", "Answer: {s}.", s=total))
    return out


_MATH = {
    "modpow": (lambda r: (r.randrange(3, 97), r.randrange(1 << 20, 1 << 30), r.randrange(10 ** 4, 10 ** 6)), _modpow,
               "Compute {0}^{1} mod {2}. Show every step."),
    "euclid": (lambda r: (r.randrange(10 ** 17, 10 ** 19), r.randrange(10 ** 16, 10 ** 18)), _euclid,
               "Find gcd({0}, {1}) and Bezout coefficients. Show your work."),
    "factor": (lambda r: (r.choice(_primes(2000)[150:]) * r.choice(_primes(2000)[120:]) * r.randrange(2, 60),), _factor,
               "Find the prime factorization of {0}. Explain each step."),
    "division": (lambda r: (r.randrange(10 ** 4, 10 ** 6), r.randrange(101, 9973), r.randrange(70, 120)), _long_division,
                 "Compute {0} / {1} to {2} decimal places by long division."),
    "series": (lambda r: (r.randrange(-50, 200), r.randrange(2, 40), r.randrange(70, 120)), _series,
               "Sum the first {2} terms of the arithmetic sequence with first term {0} and difference {1}."),
}


def _math_answer(kind: str, params, seed: int, slip: bool) -> str:
    """One sample's solution: every step of the template (in the sample's phrasing), solved
    twice when the sample 'checks by redoing' (a habit), and, with ``slip``, a mistake
    noticed and redone."""
    v = _Voice(seed)
    lines = [v.say("Let me work through this carefully.", "Okay, let me solve this step by step.",
                   "Let's think step by step.")]
    body = _MATH[kind][1](v, *params)
    lines += body
    if slip and len(body) > 6:
        at = v.rng.randrange(3, len(body) - 2)
        lines.insert(at + 1, v.say("Wait, that does not look right. Let me redo this step.",
                                   "Hmm, I made an arithmetic slip above; recomputing from here.",
                                   "Hold on, let me recheck that line."))
        lines[at + 2:at + 2] = body[at:at + 3]
    if v.maybe(0.4):
        lines.append(v.say("Let me verify the whole computation once more from the start.",
                           "To be safe, I will redo the computation.", "Double-checking everything:"))
        lines += _MATH[kind][1](_Voice(seed + 7919), *params)
    lines.append(v.say("Final answer is above.", "That completes the solution.", "Done."))
    return "\n".join(lines) + "\n"


def math_family(seed: int = 46, groups: int = 6, siblings: int = 4, independent: int = 16) -> TextFamily:
    rng = random.Random(seed)
    kinds = list(_MATH)
    fam = TextFamily("math", "worked solutions (5 templates, many instances)")
    for g in range(groups + independent):
        kind = kinds[g % len(kinds)]
        params = _MATH[kind][0](rng)
        prompt = "Problem: " + _MATH[kind][2].format(*params) + "\nSolution:\n"
        if g < groups:
            answers = [_math_answer(kind, params, seed * 1000 + g * 10 + s, slip=s % 3 == 1)
                       for s in range(siblings)]
            fam.groups.append((prompt, answers))
        else:
            fam.independent.append((prompt, _math_answer(kind, params, seed * 1000 + g * 10, slip=g % 4 == 0)))
    return fam


# -- docs: reference pages of one generated library -------------------------------------------------

_NOUNS = ("buffer", "record", "segment", "handle", "queue", "table", "index", "cursor", "block", "frame",
          "channel", "session", "snapshot", "ledger", "bucket", "lease", "shard", "token", "window", "batch",
          "journal", "schema", "column", "partition", "replica", "checkpoint", "stream", "filter", "codec", "pool")
_VERBS = ("open", "close", "merge", "split", "flush", "read", "write", "seal", "rotate", "scan", "pack",
          "unpack", "resolve", "encode", "decode", "compact", "evict", "reserve", "release", "attach",
          "detach", "validate", "restore", "publish")
_ADJS = ("sealed", "pending", "shared", "local", "remote", "stale", "active", "partial", "ordered", "sparse",
         "frozen", "volatile", "durable", "empty")
_TYPES = ("int", "str", "bytes", "float", "bool", "Sequence[int]", "Mapping[str, int]", "Path", "Callable[[], None]")
_ERRORS = ("ValueError", "KeyError", "TimeoutError", "PermissionError", "OSError", "RuntimeError")


class _Library:
    """A made-up library: modules of functions, each with the facts its reference page states."""

    def __init__(self, seed: int, modules: int, per_module: int):
        rng = random.Random(seed)
        self.name = "tessel"
        self.functions = []
        for mi in range(modules):
            mod = f"{self.name}.{_pick(rng, _NOUNS)}s{mi}"
            for _ in range(per_module):
                verb, noun = _pick(rng, _VERBS), _pick(rng, _NOUNS)
                params = []
                for pi in range(rng.randrange(2, 6)):
                    params.append((f"{_pick(rng, _ADJS)}_{_pick(rng, _NOUNS)}" if pi else noun,
                                   _pick(rng, _TYPES), rng.random() < 0.4, rng.randrange(1, 512)))
                self.functions.append(dict(
                    module=mod, name=f"{verb}_{noun}", verb=verb, noun=noun, params=params,
                    ret=_pick(rng, _TYPES), adj=_pick(rng, _ADJS), other=_pick(rng, _NOUNS),
                    errors=rng.sample(_ERRORS, rng.randrange(1, 3)), since=f"{rng.randrange(1, 4)}.{rng.randrange(0, 12)}",
                    seed=rng.randrange(1 << 30)))

    def conventions(self, v: _Voice) -> list[str]:
        n = self.name
        return [
            "## Conventions",
            v.say("Every function of {n} is safe to call from several threads unless its page says otherwise.",
                  "Unless a page says otherwise, the functions of {n} may be called from any thread.", n=n),
            v.say("Sizes are in bytes and durations in seconds, given as floats.",
                  "All sizes are counted in bytes; all durations are seconds (floats).", n=n),
            v.say("A function that takes a handle never closes it: the caller owns every handle it opened.",
                  "Handles passed in are never closed by the callee; whoever opened a handle closes it."),
            v.say("Errors are raised, never returned: a function returns only on success.",
                  "No function signals failure through its return value; it raises instead."),
            "Keyword arguments marked optional may be omitted; their defaults are listed in each table.",
            v.say("Deprecated names keep working for two minor releases and warn once per process.",
                  "A deprecated name warns once per process and is removed two minor releases later."),
            "",
        ]

    def page(self, f: dict, v: _Voice) -> list[str]:
        sig = ", ".join(f"{p}: {t}" + (f" = {d}" if opt else "") for p, t, opt, d in f["params"])
        lines = [f"### {f['module']}.{f['name']}", "", f"```python\n{f['name']}({sig}) -> {f['ret']}\n```", ""]
        fr = random.Random(f["seed"])  # the function's facts: the same on every page of it
        lines.append(v.say("{V} the {adj} {noun} and return the resulting {ret}.",
                           "{V}s the {adj} {noun}; the result is a {ret}.",
                           "This function will {verb} the {adj} {noun} and return a {ret}.",
                           V=f["verb"].capitalize(), verb=f["verb"], adj=f["adj"], noun=f["noun"], ret=f["ret"]))
        lines.append(f"It works on one {f['noun']} at a time and keeps its {f['other']} untouched "
                     f"until the call returns; a {_pick(fr, _ADJS)} {f['noun']} is "
                     f"{_pick(fr, ('refused', 'copied first', 'locked for the call', 'skipped'))}.")
        lines += ["", "| parameter | type | default | meaning |", "|---|---|---|---|"]
        for p, t, opt, d in f["params"]:
            what = (f"the {p.replace('_', ' ')} to {f['verb']}" if p == f["noun"] else
                    f"{_pick(fr, ('limit on', 'the', 'optional', 'which'))} {p.replace('_', ' ')} "
                    f"{_pick(fr, ('to use', 'to honour', 'to consult first', 'kept after the call'))}")
            lines.append(f"| `{p}` | `{t}` | {d if opt else '-'} | {what} |")
        lines.append("")
        lines.append(v.say("Returns: the {ret} produced by the call.", "**Returns** a {ret}.",
                           "Return value: {ret}.", ret=f["ret"]))
        for e in f["errors"]:
            lines.append(v.say("Raises `{e}` when the {noun} is {adj}.", "`{e}`: the {noun} was {adj}.",
                               e=e, noun=f["noun"], adj=_pick(fr, _ADJS)))
        lines += ["", "Example:", "", "```python", f"from {f['module']} import {f['name']}",
                  f"{f['noun']} = open_{f['noun']}(\"{f['noun']}-{fr.randrange(100)}\")",
                  f"result = {f['name']}({f['noun']}" + "".join(
                      f", {p}={d}" for p, t, opt, d in f["params"][1:] if opt) + ")",
                  f"assert result is not None", "```", ""]
        if v.maybe(0.5):
            lines.append(v.say("Since version {s}.", "Added in {s}.", s=f["since"]))
            lines.append("")
        return lines

    def answer(self, subset: list[int], seed: int) -> str:
        v = _Voice(seed)
        lines = [f"# {self.name} reference", ""]
        lines += self.conventions(v)
        order = list(subset)
        if v.maybe(0.3):
            order.reverse()
        for i in order:
            lines += self.page(self.functions[i], v)
        return "\n".join(lines)


def docs_family(seed: int = 46, groups: int = 6, siblings: int = 4, independent: int = 16,
                modules: int = 4, per_module: int = 12, pages: int = 7) -> TextFamily:
    """Prompts asking for the pages of ``pages`` functions each, drawn from a pool small enough
    that every function appears in several prompts."""
    lib = _Library(seed, modules, per_module)
    rng = random.Random(seed + 1)
    fam = TextFamily("docs", "reference pages sharing text across prompts")
    pool = range(len(lib.functions))
    for g in range(groups + independent):
        subset = sorted(rng.sample(pool, pages))
        names = ", ".join(f"{lib.functions[i]['module']}.{lib.functions[i]['name']}" for i in subset)
        prompt = f"Write the {lib.name} reference pages for: {names}.\n"
        if g < groups:
            fam.groups.append((prompt, [lib.answer(subset, seed * 1000 + g * 10 + s) for s in range(siblings)]))
        else:
            fam.independent.append((prompt, lib.answer(subset, seed * 1000 + g * 10)))
    return fam


# -- edits: whole modules rewritten with one change ----------------------------------------------------

def _module_source(rng: random.Random, name: str, functions: int) -> list[list[str]]:
    """A generated Python module as a list of blocks (one per function or class)."""
    blocks = [[f'"""{name}: {_pick(rng, _ADJS)} {_pick(rng, _NOUNS)} helpers (generated)."""', "",
               "from __future__ import annotations", "", "import logging", "from dataclasses import dataclass", "",
               "log = logging.getLogger(__name__)", ""]]
    for _ in range(functions):
        verb, noun, other = _pick(rng, _VERBS), _pick(rng, _NOUNS), _pick(rng, _NOUNS)
        if rng.random() < 0.3:
            fields = rng.sample(_NOUNS, rng.randrange(2, 5))
            body = ["", "@dataclass", f"class {noun.capitalize()}{other.capitalize()}:",
                    f'    """A {_pick(rng, _ADJS)} {noun} with its {other}."""', ""]
            body += [f"    {fd}: int = {rng.randrange(64)}" for fd in fields]
            body += ["", f"    def {verb}(self, limit: int) -> int:",
                     f"        total = " + " + ".join(f"self.{fd}" for fd in fields),
                     "        if total > limit:",
                     f"            raise ValueError(f\"{noun} over its limit: {{total}} > {{limit}}\")",
                     "        return total", ""]
        else:
            args = rng.sample(_NOUNS, rng.randrange(1, 4))
            body = ["", f"def {verb}_{noun}({', '.join(a + ': int' for a in args)}) -> int:",
                    f'    """{verb.capitalize()} the {noun} from its {", ".join(args)}."""',
                    "    result = 0"]
            for a in args:
                op = _pick(rng, ("+=", "-=", "^=", "|="))
                body += [f"    if {a} > {rng.randrange(1, 100)}:", f"        result {op} {a} * {rng.randrange(2, 9)}",
                         "    else:", f"        result {op} {a}"]
            body += [f"    log.debug(\"{verb}_{noun}: %d\", result)", "    return result", ""]
        blocks.append(body)
    return blocks


def _edit(blocks: list[list[str]], rng: random.Random, kind: str, target: int) -> list[list[str]]:
    """The module with one change in block ``target``."""
    out = [list(b) for b in blocks]
    b = out[target]
    if kind == "docstring":
        for i, line in enumerate(b):
            if '"""' in line:
                b.insert(i + 1, f"    # note: {_pick(rng, _VERBS)}s a {_pick(rng, _ADJS)} {_pick(rng, _NOUNS)} first")
                break
    elif kind == "guard":
        for i, line in enumerate(b):
            if line.strip().startswith(("result = 0", "total =")):
                b.insert(i + 1, f"    if {rng.randrange(2, 9)} > {rng.randrange(10, 99)}:  # never")
                b.insert(i + 2, "        return 0")
                break
    elif kind == "logging":
        for i, line in enumerate(b):
            if line.strip().startswith("return"):
                b.insert(i, f"    log.info(\"{_pick(rng, _NOUNS)} ready\")")
                break
    else:  # rename
        old = b[1].split("(")[0].split()[-1] if b[1].startswith("def ") else None
        if old:
            new = f"{_pick(rng, _VERBS)}_{old.split('_', 1)[-1]}"
            out = [[line.replace(old, new) for line in bb] for bb in out]
    return out


def edits_family(seed: int = 46, groups: int = 6, siblings: int = 4, independent: int = 16,
                 modules: int = 4, functions: int = 22) -> TextFamily:
    rng = random.Random(seed + 2)
    sources = [_module_source(rng, f"mod{i}", functions) for i in range(modules)]
    kinds = ("docstring", "guard", "logging", "rename")
    fam = TextFamily("edits", "whole modules rewritten with one change")
    for g in range(groups + independent):
        mi = g % modules
        kind, target = kinds[rng.randrange(len(kinds))], rng.randrange(1, functions + 1)
        src = "\n".join("\n".join(b) for b in sources[mi])
        prompt = f"Here is mod{mi}.py:\n```python\n{src}\n```\nApply this change: {kind} in block {target}. " \
                 f"Reply with the whole file.\n"

        def sample(s):
            edited = _edit(sources[mi], random.Random(seed * 1000 + g * 10 + s), kind, target)
            return "```python\n" + "\n".join("\n".join(b) for b in edited) + "\n```\n"
        if g < groups:
            fam.groups.append((prompt, [sample(s) for s in range(siblings)]))
        else:
            fam.independent.append((prompt, sample(0)))
    return fam


FAMILIES = {"math": math_family, "docs": docs_family, "edits": edits_family}


def family(name: str) -> TextFamily:
    try:
        return FAMILIES[name]()
    except KeyError:
        raise ValueError(f"text family must be one of {sorted(FAMILIES)}, got {name!r}") from None
