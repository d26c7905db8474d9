#!/usr/bin/env python3
"""Writes tests/fixtures/grading/*.jsonl, the answer-grading table of tests/lua/test_eval_grade.lua.

Every expected score, verdict and extracted answer comes from running the reference graders
themselves, loaded by file path from the released packages (nothing is re-implemented here):

    verl 0.9.1        verl/utils/reward_score/gsm8k.py        -> verl_gsm8k, verl_gsm8k_flexible
                      verl/utils/reward_score/math_reward.py  -> verl_math
                      verl/utils/reward_score/math_dapo.py    -> verl_math_dapo
    skyrl-gym 0.4.0   skyrl_gym/envs/gsm8k/utils.py           -> skyrl_gsm8k
                      skyrl_gym/envs/aime/utils.py            -> skyrl_aime

and lunar's own `aime` grader (docs/formats.md of the reference notes, 8.3: AIME answers are
compared as integers), defined below as verl_math_dapo's verdict except that an integer
prediction and an integer (normalised) gold answer are compared by value.

The gold answers of the shipped GSM8K test set (examples/data/eval/gsm8k_test.jsonl) come from
the "#### <number>" rule of verl's examples/data_preprocess/gsm8k.py (first match, commas
removed), written out below because that script is not part of the wheel.

Developer machines only (CI reads the committed JSONL):
    pip install --no-deps --target /tmp/grading_ref verl==0.9.1 skyrl-gym==0.4.0
    python3 tests/ref/make_grading_fixtures.py /tmp/grading_ref
"""
import contextlib
import hashlib
import importlib.util
import io
import json
import os
import random
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")
OUT = os.path.join(ROOT, "tests", "fixtures", "grading")
PINS = {"verl": "0.9.1", "skyrl_gym": "0.4.0"}
FILES = {
    "verl_gsm8k": "verl/utils/reward_score/gsm8k.py",
    "verl_math": "verl/utils/reward_score/math_reward.py",
    "verl_math_dapo": "verl/utils/reward_score/math_dapo.py",
    "skyrl_gsm8k": "skyrl_gym/envs/gsm8k/utils.py",
    "skyrl_aime": "skyrl_gym/envs/aime/utils.py",
}


def load(ref, key):
    path = os.path.join(ref, FILES[key])
    spec = importlib.util.spec_from_file_location("ref_" + key, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    return mod, digest


def check_versions(ref):
    for dist, pin in PINS.items():
        name = dist + "-" + pin + ".dist-info"
        if not os.path.isdir(os.path.join(ref, name)):
            sys.exit("make_grading_fixtures: %s not found under %s (install %s==%s there)" % (name, ref, dist, pin))


class Graders:
    def __init__(self, ref):
        self.gsm8k, h1 = load(ref, "verl_gsm8k")
        self.math, h2 = load(ref, "verl_math")
        self.dapo, h3 = load(ref, "verl_math_dapo")
        self.sk_gsm8k, h4 = load(ref, "skyrl_gsm8k")
        self.sk_aime, h5 = load(ref, "skyrl_aime")
        self.sha256 = dict(zip(FILES, [h1, h2, h3, h4, h5]))

    # Each returns (score, correct, pred); pred is the extracted answer the reference compares
    # (None when it found none).
    def verl_gsm8k(self, response, gold, method="strict"):
        score = self.gsm8k.compute_score(response, gold, method=method)
        pred = self.gsm8k.extract_solution(response, method=method)
        return float(score), score == 1.0, pred

    def verl_gsm8k_flexible(self, response, gold):
        return self.verl_gsm8k(response, gold, "flexible")

    def skyrl_gsm8k(self, response, gold):
        score = self.sk_gsm8k.compute_score(response, gold)
        pred = self.sk_gsm8k.extract_solution(response)
        return float(score), score == 1.0, pred

    def verl_math(self, response, gold):
        with contextlib.redirect_stdout(io.StringIO()):   # compute_score prints what it catches
            score = self.math.compute_score(response, gold)
        pred = None
        try:
            box = self.math.last_boxed_only_string(response)
            if box is not None:
                pred = self.math.remove_boxed(box)
        except AssertionError:
            pred = None
        return float(score), score == 1.0, pred

    def verl_math_dapo(self, response, gold):
        r = self.dapo.compute_score(response, gold)
        return float(r["score"]), bool(r["acc"]), r["pred"]

    def skyrl_aime(self, response, gold):
        r = self.sk_aime.compute_score(response, gold)
        return float(r["score"]), bool(r["acc"]), r["pred"]

    def aime(self, response, gold):
        score, correct, pred = self.verl_math_dapo(response, gold)
        gold_n = self.dapo.normalize_final_answer(gold)
        integer = re.compile(r"-?[0-9]+\Z")
        if pred is not None and integer.match(pred) and integer.match(gold_n):
            correct = int(pred) == int(gold_n)
            score = 1.0 if correct else -1.0
        return score, correct, pred


GSM8K_GRADERS = ["verl_gsm8k", "verl_gsm8k_flexible", "skyrl_gsm8k"]
MATH_GRADERS = ["verl_math"]
DAPO_GRADERS = ["verl_math_dapo", "skyrl_aime", "aime"]
ALL_GRADERS = GSM8K_GRADERS + MATH_GRADERS + DAPO_GRADERS
DATASET_OF = {"verl_gsm8k": "gsm8k", "verl_gsm8k_flexible": "gsm8k", "skyrl_gsm8k": "gsm8k",
              "verl_math": "MATH-500", "verl_math_dapo": "DAPO-17k", "skyrl_aime": "AIME-2024-30",
              "aime": "AIME-2024-30"}

LONG = "Let me work through this carefully, one step at a time. " * 6   # 336 characters
PAD_UNI = "×÷ – ≈ 数学 " * 40                                          # multi-byte padding

# (case, response, gold): every case is run through every grader of its family.
GSM8K_CASES = [
    ("plain ####", "She has 3 + 4 = 7 apples.\n#### 7", "7"),
    ("#### wrong number", "#### 8", "7"),
    ("#### thousands separator", "Total: 1,000 dollars.\n#### 1,000", "1000"),
    ("#### big thousands", "#### 109,200,000", "109200000"),
    ("#### negative", "The change is -5.\n#### -5", "-5"),
    ("#### decimal vs integer", "#### 18.0", "18"),
    ("#### decimal gold", "#### 2.5", "2.5"),
    ("#### trailing period", "#### 72.", "72"),
    ("#### dollar sign before the number", "#### $72", "72"),
    ("#### no space", "####72", "72"),
    ("#### two spaces", "####  72", "72"),
    ("five hashes", "##### 72", "72"),
    ("two #### lines, last right", "#### 5\nWait, I made an error.\n#### 7", "7"),
    ("two #### lines, first right", "#### 7\nHmm, on reflection:\n#### 5", "7"),
    ("#### inside the text then a final one", "Use the #### 3 marker. Final:\n#### 12", "12"),
    ("The answer is N", "So she makes 18 dollars. The answer is 18", "18"),
    ("The answer is N.", "So she makes 18 dollars. The answer is 18.", "18"),
    ("Answer: N", "Answer: 18", "18"),
    ("Answer: $N", "Answer: $18", "18"),
    ("last number only", "3 + 4 = 7", "7"),
    ("last number is a step", "The answer is 7 because 3 + 4 = 7 and 2 * 1 = 2", "7"),
    ("boxed answer", "The final answer is \\boxed{18}", "18"),
    ("empty response", "", "18"),
    ("no number at all", "I do not know.", "18"),
    ("only a period", ".", "18"),
    ("only periods and commas", ". , .", "18"),
    ("minus sign only", "#### -", "18"),
    ("#### then words", "#### eighteen", "18"),
    ("#### with comma decimal", "#### 1,234.50", "1234.50"),
    ("thousands in flexible", "He earns 1,000 a month", "1000"),
    ("negative flexible", "The temperature fell to -3", "-3"),
    ("double minus", "#### --4", "-4"),
    ("#### beyond 300 chars, then prose", "#### 42\n" + LONG, "42"),
    ("#### within the last 300 chars", LONG + "\n#### 42", "42"),
    ("prose #### early, right answer late", "#### 1\n" + LONG + "\n#### 42", "42"),
    ("wrong #### late after a long right one", "#### 42\n" + LONG + "#### 41", "42"),
    ("multibyte padding before ####", PAD_UNI + "#### 42", "42"),
    ("#### just inside 300 characters", "#### 42" + "é" * 293, "42"),
    ("#### just outside 300 characters", "#### 42" + "é" * 294, "42"),
    ("think block", "<think>3 + 4 = 7</think>\n#### 7", "7"),
    ("gold with comma (unprocessed)", "#### 1000", "1,000"),
    ("trailing spaces after number", "#### 7   ", "7"),
    ("#### number then unit", "#### 7 apples", "7"),
    ("#### leading zero", "#### 07", "7"),
    ("#### plus sign", "#### +7", "7"),
    ("full-width digits", "#### ７", "7"),
    ("percent", "#### 50%", "50"),
    ("fraction", "#### 1/2", "0.5"),
    ("0.5 vs 1/2 flexible", "half of it: 0.5", "0.5"),
    ("newline between #### and number", "####\n7", "7"),
]

MATH_CASES = [
    ("boxed integer", "Thus the answer is $\\boxed{216}$.", "216"),
    ("boxed wrong", "Thus the answer is $\\boxed{215}$.", "216"),
    ("nested braces frac", "So $x = \\boxed{\\frac{1}{16}}$.", "\\frac{1}{16}"),
    ("dfrac vs frac", "\\boxed{\\dfrac{9}{19}}", "\\frac{9}{19}"),
    ("tfrac vs frac", "\\boxed{\\tfrac{9}{19}}", "\\frac{9}{19}"),
    ("frac shorthand", "\\boxed{\\frac12}", "\\frac{1}{2}"),
    ("frac shorthand with brace", "\\boxed{\\frac1{72}}", "\\frac{1}{72}"),
    ("a/b vs frac", "\\boxed{9/19}", "\\frac{9}{19}"),
    ("negative a/b", "\\boxed{-3/8}", "-\\frac{3}{8}"),
    ("0.5 vs frac 1/2", "\\boxed{0.5}", "\\frac{1}{2}"),
    ("frac 1/2 vs 0.5 gold", "\\boxed{\\frac{1}{2}}", "0.5"),
    ("0.50 vs frac 1/2", "\\boxed{0.50}", "\\frac{1}{2}"),
    ("decimal .5 vs 0.5", "\\boxed{.5}", "0.5"),
    ("sqrt shorthand", "\\boxed{16\\sqrt3}", "16\\sqrt{3}"),
    ("nested sqrt in frac", "\\boxed{\\frac{\\sqrt{3}}{3}}", "\\frac{\\sqrt{3}}{3}"),
    ("left/right parens", "\\boxed{\\left(2,\\infty\\right)}", "(2,\\infty)"),
    ("spaces inside", "\\boxed{ 3 \\pm 2 \\sqrt{2} }", "3\\pm2\\sqrt{2}"),
    ("thin space", "\\boxed{1\\!000}", "1000"),
    ("thousands separator", "\\boxed{1,000}", "1000"),
    ("thousands separator gold", "\\boxed{26000}", "26,000"),
    ("degrees", "\\boxed{90^\\circ}", "90"),
    ("degrees braced", "\\boxed{90^{\\circ}}", "90"),
    ("dollars", "\\boxed{\\$18.90}", "18.90"),
    ("percent", "\\boxed{50\\%}", "50"),
    ("plain percent", "\\boxed{50%}", "50"),
    ("units text", "\\boxed{5 \\text{ cm}}", "5"),
    ("two unit texts", "\\boxed{5 \\text{ cm} \\text{ long}}", "5"),
    ("text answer", "\\boxed{\\text{Evelyn}}", "\\text{Evelyn}"),
    ("k = prefix", "\\boxed{k = 2}", "2"),
    ("long prefix not removed", "\\boxed{abc = 2}", "2"),
    ("x in interval", "\\boxed{x \\in [-2,7]}", "x\\in[-2,7]"),
    ("several boxed, last right", "First \\boxed{3}, then corrected: \\boxed{5}", "5"),
    ("several boxed, first right", "First \\boxed{5}, then changed: \\boxed{3}", "5"),
    ("boxed in prompt echo", "Put your final answer within \\boxed{}. The answer is 5.", "5"),
    ("boxed in prompt echo then answer", "Put your final answer in \\boxed{}.\n... so \\boxed{5}", "5"),
    ("boxed space form", "The answer is \\boxed 5$.", "5"),
    ("boxed space form beats later braces", "\\boxed 3$ and later \\boxed{5}", "5"),
    ("fbox", "\\fbox{5}", "5"),
    ("unclosed boxed", "\\boxed{5", "5"),
    ("boxed without brace", "\\boxed5", "5"),
    ("no boxed", "The answer is 5.", "5"),
    ("empty response", "", "5"),
    ("empty boxed vs empty gold", "\\boxed{}", ""),
    ("matrix", "\\boxed{\\begin{pmatrix}-1/3\\\\2/3\\\\5/3\\end{pmatrix}}",
     "\\begin{pmatrix}-1/3\\2/3\\5/3\\end{pmatrix}"),
    ("base subscript", "\\boxed{40_9}", "40_9"),
    ("pi", "\\boxed{\\pi}", "\\pi"),
    ("frac with pi", "\\boxed{\\dfrac{20000}{\\pi}}", "\\frac{20000}{\\pi}"),
    ("trailing frac (error path)", "\\boxed{3\\frac}", "3\\frac"),
    ("trailing sqrt (error path)", "\\boxed{2\\sqrt}", "2\\sqrt"),
    ("frac with one char (kept)", "\\boxed{\\frac1}", "\\frac1"),
    ("leading zero a/b", "\\boxed{01/2}", "\\frac{1}{2}"),
    ("answer beyond any clip", "\\boxed{42}" + LONG, "42"),
    ("multibyte frac shorthand", "\\boxed{\\fracé2}", "\\frac{é}{2}"),
    ("newline inside boxed", "\\boxed{1\n2}", "12"),
    ("double backslash", "\\boxed{\\\\frac{1}{2}}", "\\frac{1}{2}"),
    ("ordered pair", "\\boxed{(2, 12)}", "(2,12)"),
    ("negative", "\\boxed{-128}", "-128"),
    ("negative frac", "\\boxed{-\\dfrac{3}{8}}", "-\\frac{3}{8}"),
    ("mixed number", "\\boxed{137\\frac{1}{2}}", "137\\frac{1}{2}"),
    ("braced word", "\\boxed{\\text{(C)}}", "\\text{(C)}"),
    # Python's int() reads at most 4300 digits: a longer a/b stays as written
    ("a/b with 4300 digits", "\\boxed{" + "7" * 4300 + "/2}", "\\frac{" + "7" * 4300 + "}{2}"),
    ("a/b with 4301 digits", "\\boxed{" + "7" * 4301 + "/2}", "\\frac{" + "7" * 4301 + "}{2}"),
]

DAPO_CASES = [
    ("Answer: N", "Step 1...\nAnswer: 34", "34"),
    ("Answer: wrong", "Answer: 35", "34"),
    ("lower case answer:", "answer: 34", "34"),
    ("upper case ANSWER:", "ANSWER: 34", "34"),
    ("space before colon", "Answer : 34", "34"),
    ("no space after colon", "Answer:34", "34"),
    ("answer on next line", "Answer:\n34", "34"),
    ("answer after blank line", "Answer:\n\n  34", "34"),
    ("answer then spaces at end", "Answer:   ", "34"),
    ("Final Answer:", "Final Answer: 34", "34"),
    ("Answer is (no colon)", "The Answer is 34", "34"),
    ("two Answer lines, last right", "Answer: 12\nOn reflection:\nAnswer: 34", "34"),
    ("two Answer lines, first right", "Answer: 34\nOn reflection:\nAnswer: 12", "34"),
    ("Answer inside an Answer line", "Answer: Answer: 34", "34"),
    ("dollar math", "Answer: $34$", "34"),
    ("dollar math with text", "Answer: the value is $34$ exactly", "34"),
    ("escaped dollars", "Answer: \\$34", "34"),
    ("thousands separator", "Answer: 1,000", "1000"),
    ("thousands separator in gold", "Answer: 1000", "1,000"),
    ("negative", "Answer: -3", "-3"),
    ("negative vs positive", "Answer: 3", "-3"),
    ("leading zero gold", "Answer: 33", "033"),
    ("leading zero both", "Answer: 033", "033"),
    ("leading zero pred", "Answer: 033", "33"),
    ("degree gold", "Answer: 336", "336^\\circ"),
    ("degree both", "Answer: 336^\\circ", "336^\\circ"),
    ("equation", "Answer: x = 34", "34"),
    ("units words", "Answer: 34 degrees", "34"),
    ("units cm", "Answer: 34 cm", "34"),
    ("dollars word", "Answer: 34 dollars", "34"),
    ("text unit", "Answer: 34\\text{ meters}", "34"),
    ("mbox", "Answer: \\mbox{34}", "34"),
    ("textbf", "Answer: \\textbf{34}", "34"),
    ("boxed on the answer line", "Answer: \\boxed{34}", "34"),
    ("boxed nested on the answer line", "Answer: \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("frac shorthand", "Answer: \\frac12", "\\frac{1}{2}"),
    ("dfrac vs frac", "Answer: \\dfrac{1}{2}", "\\frac{1}{2}"),
    ("0.5 vs frac", "Answer: 0.5", "\\frac{1}{2}"),
    ("sqrt shorthand", "Answer: 2\\sqrt3", "2\\sqrt{3}"),
    ("trailing period", "Answer: 34.", "34"),
    ("trailing text", "Answer: 34. I hope this helps!", "34"),
    ("think tag after answer", "Answer: 34</think>", "34"),
    ("tag after answer with space", "Answer: 34 </s>", "34"),
    ("tag right after colon", "Answer: <b>34</b>", "34"),
    ("article a", "Answer: a 34", "34"),
    ("word an inside", "Answer: Ian 34", "34"),
    ("boxed only (fallback)", "So the result is \\boxed{34}", "34"),
    ("boxed only, nested", "So the result is \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("boxed only, leading zero gold", "So the result is \\boxed{33}", "033"),
    ("boxed only, spaced", "So the result is \\boxed{ 34 }", "34"),
    ("boxed only, far from end", "\\boxed{34}" + " and that is the reasoning." * 4, "34"),
    ("several boxed, last wins", "\\boxed{12} no wait \\boxed{34}", "34"),
    ("boxed in prompt echo", "Put the answer in \\boxed{}. I think 34.", "34"),
    ("empty response", "", "34"),
    ("only whitespace", "   \n  ", "34"),
    ("[INVALID] literally", "Answer: [INVALID]", "34"),
    ("Answer beyond 300 chars", "Answer: 34\n" + LONG, "34"),
    ("Answer within 300 chars", LONG + "\nAnswer: 34", "34"),
    ("multibyte padding", PAD_UNI + "\nAnswer: 34", "34"),
    ("answer in the clipped window edge", "Answer: 34" + "é" * 290, "34"),
    ("answer cut by the clip", "Answer: 34" + "é" * 292, "34"),
    ("long s in Answer", "Anſwer: 34", "34"),
    ("no-break space after colon", "Answer:\u00a034", "34"),
    ("ideographic space after colon", "Answer:\u300034", "34"),
    ("superscript digits with comma", "Answer: 1,²", "1²"),
    ("arabic-indic digits", "Answer: ٣٤", "34"),
    ("big integer", "Answer: 123456789012345678901234567890", "123456789012345678901234567890"),
    ("negative big integer", "Answer: -00012", "-12"),
    ("minus zero", "Answer: -0", "0"),
    ("gsm8k style", "#### 34", "34"),
    ("thousands with spaces", "Answer: 1 000", "1000"),
    ("ldots list", "Answer: 1, 2, \\ldots", "1,2,"),
    ("percent", "Answer: 50\\%", "50"),
    ("comma-separated list", "Answer: 2, 3", "2,3"),
    ("overline", "Answer: 0.\\overline{3}", "0.3"),
    ("text with and", "Answer: 2 \\text{and} 3", "2,3"),
    ("quotes", "Answer: \"34\"", "34"),
    ("equals in gold", "Answer: 34", "x=34"),
    ("newline in gold", "Answer: 34", "34\n"),
]

# Responses run through every grader: the same text scores differently under each dataset's rule.
CROSS_CASES = [
    ("0.5 vs frac 1/2 in every form", ["#### 0.5", "Answer: 0.5", "\\boxed{0.5}"], ["\\frac{1}{2}", "0.5"]),
    ("1,000 vs 1000 in every form", ["#### 1,000", "Answer: 1,000", "\\boxed{1,000}"], ["1000", "1,000"]),
    ("negative in every form", ["#### -7", "Answer: -7", "\\boxed{-7}"], ["-7", "7"]),
    ("percent in every form", ["#### 50", "Answer: 50\\%", "\\boxed{50\\%}"], ["50", "50\\%"]),
    ("units in every form", ["#### 5", "Answer: 5 cm", "\\boxed{5\\text{ cm}}"], ["5"]),
    ("every marker at once", ["#### 3\nAnswer: 4\n\\boxed{5}", "\\boxed{5}\nAnswer: 4\n#### 3"], ["3", "4", "5"]),
    ("empty", [""], ["", "0"]),
]


def random_cases(seed):
    """Seeded random texts from each family's alphabet (extraction corner cases by construction)."""
    rng = random.Random(seed)
    alphabets = {
        "gsm8k": ["####", "#### ", " ", "-", "12", "7", "0", "1,000", ".", ",", "$", "\n", "The answer is ",
                  "Answer: ", "é", "\\boxed{", "}", "x"],
        "math": ["\\boxed{", "\\boxed ", "\\fbox{", "{", "}", "$", "\\frac", "\\dfrac", "\\tfrac", "1", "2", "12",
                 "/", ".", "0.5", "\\text{ ", "cm}", "\\sqrt", "3", "=", "k", " ", "\\!", "\\\\", "\\left(",
                 "\\right)", "^\\circ", "\\%", "-", ",", "\n", "é", "²", "a"],
        "dapo": ["Answer", "answer", "ANSWER", "Anſwer", ":", " ", "\u00a0", "\u3000", "\n", "<", "</think>",
                 "\\boxed{", "}", "{", "$", "=", "34", "-3", "033", "1,000", "\\text{", "units", "degrees", "an ",
                 "a ", "\\frac", "12", "\\sqrt", "x", ".", ",", "\\!", "\\;", "{,}", "\"", "\\mathrm{th}",
                 "^\\circ", "[INVALID]", "²", "٣", "\\overline{", "\\textbf{", "mbox", "\\$"],
    }
    golds = {
        "gsm8k": ["7", "12", "-7", "1000", "0", "12.", "1,000", "0.5"],
        "math": ["12", "\\frac{1}{2}", "\\frac12", "0.5", "3", "-12", "1/2", "k=2", "\\sqrt{3}", "12\\%", "",
                 "2\\sqrt{3}", "(2,3)"],
        "dapo": ["34", "-3", "033", "33", "1000", "1,000", "\\frac{1}{2}", "x=34", "34 degrees", "[INVALID]", ""],
    }
    out = []
    for family, graders in (("gsm8k", GSM8K_GRADERS), ("math", MATH_GRADERS), ("dapo", DAPO_GRADERS)):
        count = {"gsm8k": 60, "math": 140, "dapo": 90}[family]
        for i in range(count):
            pieces = [rng.choice(alphabets[family]) for _ in range(rng.randint(1, 14))]
            text = "".join(pieces)
            r = rng.random()
            if r < 0.15:
                text = LONG + text           # the interesting part inside the clip
            elif r < 0.25:
                text = text + LONG[: rng.randint(1, 300)]   # maybe pushed out of it
            elif r < 0.3:
                text = PAD_UNI[: rng.randint(100, 400)] + text
            gold = rng.choice(golds[family])
            if rng.random() < 0.3:
                # a gold answer that the text states, so that some rows score
                m = re.findall(r"-?[0-9][0-9.,]*", text)
                if m:
                    gold = m[-1]
            for g in graders:
                out.append(("random %s %d" % (family, i), g, text, gold))
    return out


def write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def gsm8k_gold(answer):
    m = re.search("#### (\\-?[0-9\\.\\,]+)", answer)
    assert m is not None, answer
    return m.group(0).split("#### ")[1].replace(",", "")


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    ref = sys.argv[1]
    check_versions(ref)
    G = Graders(ref)
    os.makedirs(OUT, exist_ok=True)

    def row(case, grader, response, gold):
        score, correct, pred = getattr(G, grader)(response, gold)
        return {"grader": grader, "dataset": DATASET_OF[grader], "case": case, "response": response,
                "gold": gold, "score": score, "correct": correct, "pred": pred}

    files = {
        "gsm8k.jsonl": [row(c, g, r, a) for c, r, a in GSM8K_CASES for g in GSM8K_GRADERS],
        "math.jsonl": [row(c, g, r, a) for c, r, a in MATH_CASES for g in MATH_GRADERS],
        "dapo.jsonl": [row(c, g, r, a) for c, r, a in DAPO_CASES for g in DAPO_GRADERS],
        "cross.jsonl": [row(c, g, r, a) for c, rs, gs in CROSS_CASES for r in rs for a in gs for g in ALL_GRADERS],
        "random.jsonl": [row(c, g, r, a) for c, g, r, a in random_cases(11)],
    }
    total = 0
    for name, rows in files.items():
        write_jsonl(os.path.join(OUT, name), rows)
        total += len(rows)
        print("%-14s %4d rows, %3d correct" % (name, len(rows), sum(r["correct"] for r in rows)))

    # the gold answers of the shipped GSM8K test set
    with open(os.path.join(ROOT, "examples", "data", "eval", "gsm8k_test.jsonl"), encoding="utf-8") as f:
        golds = [gsm8k_gold(json.loads(line)["answer"]) for line in f]
    with open(os.path.join(OUT, "gsm8k_test_golds.json"), "w") as f:
        json.dump(golds, f)
        f.write("\n")

    with open(os.path.join(OUT, "SOURCES.json"), "w") as f:
        json.dump({"generator": "tests/ref/make_grading_fixtures.py", "packages": PINS,
                   "python": sys.version.split()[0], "reference_sha256": G.sha256,
                   "rows": total, "gsm8k_test_golds": len(golds)}, f, indent=1)
        f.write("\n")
    print("total %d rows; %d GSM8K test golds" % (total, len(golds)))


if __name__ == "__main__":
    main()
