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

# ---- more cases, each response with one or more gold answers ---------------------------------
# What RL rewards meet in practice: stop tokens left after the answer, long reasoning that the
# 300-character clip cuts, thousands separators, units, LaTeX, zero-padded golds, "####" and
# "Answer:" variants, nested \boxed{}.

def expand(cases):
    return [("%s [gold %s]" % (case, gold), response, gold) for case, response, golds in cases for gold in golds]


# ~620 characters of reasoning with numbers in every line (what the flexible rule would pick up)
REASONING = "".join("Step %d: %d apples plus %d apples make %d apples in basket %d.\n" % (i, 3 * i, i + 4, 4 * i + 4, i)
                    for i in range(1, 12))
STOPS = ["<|user|>", "<|endoftext|>", "</s>", "<|im_end|>", "<|eot_id|>", "<|observation|>"]


def clip_edge(answer, k, pad="x"):
    """The answer followed by k characters: the clip keeps the answer while len(answer) + k <= 300."""
    return answer + pad * k


GSM8K_MORE = [
    # "#### N" variants
    ("#### one space", "#### 72", ["72", "73"]),
    ("#### tab", "####\t72", ["72"]),
    ("#### three hashes", "### 72", ["72"]),
    ("#### six hashes", "###### 72", ["72"]),
    ("#### colon", "####: 72", ["72"]),
    ("#### equals", "#### = 72", ["72"]),
    ("#### dollar after the number", "#### 72$", ["72"]),
    ("#### dollar and comma", "#### $1,000", ["1000"]),
    ("#### escaped dollar", "#### \\$72", ["72"]),
    ("#### bold", "#### **72**", ["72"]),
    ("bold around ####", "**#### 72**", ["72"]),
    ("#### in a sentence", "The final answer is #### 72 dollars.", ["72"]),
    ("#### boxed", "#### \\boxed{72}", ["72"]),
    ("#### dollar math", "#### $72$", ["72"]),
    ("#### negative decimal", "#### -2.5", ["-2.5", "2.5"]),
    ("#### minus then space", "#### - 5", ["-5"]),
    ("#### unicode minus", "#### \u22125", ["-5"]),
    ("#### parenthesised negative", "#### (-5)", ["-5"]),
    ("#### decimal zero", "#### 72.0", ["72", "72.0"]),
    ("#### two decimals", "#### 2.50", ["2.5", "2.50"]),
    ("#### leading comma", "#### ,72", ["72"]),
    ("#### trailing comma", "#### 72,", ["72"]),
    ("#### misplaced comma", "#### 10,00", ["1000"]),
    ("#### European decimal", "#### 1.234,5", ["1234.5", "1.2345"]),
    ("#### million", "#### 1,234,567", ["1234567"]),
    ("#### space thousands", "#### 1 000", ["1000"]),
    ("#### leading dot", "#### .5", ["0.5", ".5"]),
    ("#### arabic-indic digits", "#### \u0667\u0662", ["72"]),
    ("#### empty then number", "####\n#### 72", ["72"]),
    ("#### twice on a line", "#### 5 #### 7", ["5", "7"]),
    ("#### three times", "#### 1\n#### 2\n#### 3", ["1", "3"]),
    ("#### then a correction without ####", "#### 5\nActually it is 7.", ["5", "7"]),
    ("#### at the start of the text", "#### 12\nBecause 3 * 4 = 12.", ["12"]),
    ("#### after Answer:", "Answer: #### 72", ["72"]),
    # zero-padded and zero golds
    ("padded gold, plain answer", "#### 7", ["007", "7"]),
    ("padded answer", "#### 007", ["007", "7"]),
    ("zero", "#### 0", ["0", "00"]),
    ("double zero", "#### 00", ["0"]),
    ("minus zero", "#### -0", ["0", "-0"]),
    # units and LaTeX around the number
    ("#### number with unit", "#### 72 apples", ["72"]),
    ("#### number with percent", "#### 72%", ["72"]),
    ("#### money with cents", "#### $18.00", ["18", "18.00"]),
    ("prose with unit", "She makes 18 dollars every day.", ["18"]),
    ("prose with money", "She makes $18.00 every day.", ["18", "18.00"]),
    ("boxed only", "So the answer is $\\boxed{72}$.", ["72"]),
    ("Answer: line only", "Answer: 72", ["72"]),
    ("fraction LaTeX", "#### \\frac{1}{2}", ["0.5"]),
    ("thousands in prose", "The total is 1,000.", ["1000", "1,000", "1,000."]),
    # stop tokens right after the answer
] + [("#### then stop token %s" % s, "#### 72" + s, ["72"]) for s in STOPS] + [
    ("#### then space and stop token", "#### 72 <|user|>", ["72"]),
    ("#### then stop token and a new turn", "#### 72<|user|>\nWhat is 3 + 4?", ["72"]),
    ("#### then stop token and another answer", "#### 72<|endoftext|>Question: next.\n#### 5", ["72", "5"]),
    ("stop token with a digit", "#### 72<|reserved_special_token_0|>", ["72"]),
    ("prose answer then stop token", "The answer is 72.</s>", ["72"]),
    # long reasoning and the 300-character clip (verl clips, SkyRL reads everything)
    ("long reasoning then ####", REASONING + "#### 72", ["72"]),
    ("#### then long reasoning", "#### 72\n" + REASONING, ["72", "48"]),
    ("long reasoning, wrong ####, long reasoning, right ####", "#### 5\n" + REASONING + "#### 72", ["72", "5"]),
    ("right #### cut, wrong #### kept", "#### 72\n" + REASONING + "#### 5\n" + REASONING[:200], ["72", "5"]),
    ("reasoning with no ####", REASONING, ["48", "11"]),
] + [("#### then %d filler characters" % k, clip_edge("#### 72", k), ["72"]) for k in (292, 293, 294, 295, 296)] + [
    ("#### then %d multibyte characters" % k, clip_edge("#### 72", k, "\u00e9"), ["72"]) for k in (293, 294)] + [
    ("#### cut to its number", clip_edge("#### 12345", 295), ["12345", "2345", "45"]),
]

MATH_MORE = [
    # nested \boxed{}
    ("boxed inside boxed", "\\boxed{\\boxed{5}}", ["5", "\\boxed{5}"]),
    ("boxed frac of sqrt", "\\boxed{\\frac{\\sqrt{2}}{2}}", ["\\frac{\\sqrt{2}}{2}", "\\frac{\\sqrt2}{2}"]),
    ("boxed with deep braces", "\\boxed{\\left\\{ \\{1\\}, \\{2, 3\\} \\right\\}}", ["\\{\\{1\\},\\{2,3\\}\\}"]),
    ("boxed exponent", "\\boxed{2^{10}}", ["2^{10}", "1024"]),
    ("boxed then stray close brace", "\\boxed{5}}", ["5"]),
    ("boxed with unbalanced open brace", "\\boxed{{5}", ["5"]),
    ("two boxed, nested last", "\\boxed{3} then \\boxed{\\frac{1}{\\boxed{2}}}", ["\\frac{1}{\\boxed{2}}", "3"]),
    # stop tokens after the answer
] + [("boxed then stop token %s" % s, "The answer is \\boxed{5}." + s, ["5"]) for s in STOPS] + [
    ("stop token inside boxed", "\\boxed{5<|user|>}", ["5"]),
    ("boxed then stop token and another boxed", "\\boxed{5}<|endoftext|>Next: \\boxed{7}", ["5", "7"]),
    # units, separators, LaTeX forms
    ("unit text without space", "\\boxed{5\\text{cm}}", ["5"]),
    ("unit with backslash space", "\\boxed{5\\ \\text{cm}}", ["5"]),
    ("mbox unit", "\\boxed{5 \\mbox{ cm}}", ["5"]),
    ("square units", "\\boxed{25 \\text{ cm}^2}", ["25"]),
    ("braced comma thousands", "\\boxed{1{,}000}", ["1000", "1{,}000"]),
    ("thin space thousands", "\\boxed{1\\,000}", ["1000"]),
    ("million", "\\boxed{1,000,000}", ["1000000", "1,000,000"]),
    ("padded integer", "\\boxed{007}", ["7", "007"]),
    ("padded gold", "\\boxed{7}", ["007"]),
    ("dollars in text", "\\boxed{\\text{\\$}5}", ["5"]),
    ("infinity", "\\boxed{\\infty}", ["\\infty"]),
    ("negative infinity interval", "\\boxed{(-\\infty, 3]}", ["(-\\infty,3]"]),
    ("set", "\\boxed{\\{1, 2\\}}", ["\\{1,2\\}"]),
    ("letter choice", "\\boxed{\\text{(A)}}", ["A", "\\text{(A)}"]),
    ("plain letter", "\\boxed{A}", ["A", "(A)"]),
    ("degrees word", "\\boxed{30 \\text{ degrees}}", ["30"]),
    ("x equals", "\\boxed{x = 5}", ["5", "x=5"]),
    ("y equals with long name", "\\boxed{xyz = 5}", ["5"]),
    ("two equals", "\\boxed{x = y = 5}", ["5"]),
    ("sqrt over", "\\boxed{\\sqrt{2}/2}", ["\\frac{\\sqrt{2}}{2}"]),
    ("decimal", "\\boxed{2.50}", ["2.5", "2.50"]),
    ("frac a/b with spaces", "\\boxed{3 / 4}", ["\\frac{3}{4}"]),
    ("dfrac negative exponent", "\\boxed{2^{-\\dfrac{1}{2}}}", ["2^{-\\frac{1}{2}}"]),
    ("cdot", "\\boxed{2 \\cdot 3}", ["2\\cdot3", "6"]),
    ("pm", "\\boxed{\\pm 2}", ["\\pm2"]),
    # where the answer sits
    ("Answer: line, no boxed", "Answer: 5", ["5"]),
    ("boxed early, long reasoning after", "\\boxed{5}\n" + REASONING, ["5"]),
    ("long reasoning, then boxed", REASONING + "So \\boxed{48}.", ["48"]),
    ("boxed in dollars", "$\\boxed{5}$", ["5"]),
    ("double dollars", "$$\\boxed{5}$$", ["5"]),
    ("boxed space form with newline", "\\boxed 5\nand so on", ["5", "5\nand so on"]),
]

DAPO_MORE = [
    # "Answer:" variants
    ("bold Answer label", "**Answer:** 34", ["34"]),
    ("bold Answer line", "**Answer: 34**", ["34"]),
    ("Final answer label", "Final answer: 34", ["34"]),
    ("Answer then period", "Answer: 34.", ["34"]),
    ("Answer with boxed in dollars", "Answer: $\\boxed{34}$", ["34"]),
    ("Answer with explanation", "Answer: 34 (since 2 * 17 = 34)", ["34"]),
    ("Answer equation with dollars", "Answer: $x = 34$", ["34"]),
    ("Answer with two equals", "Answer: 34 = 34", ["34"]),
    ("Answer is, no colon", "The answer is 34", ["34"]),
    ("Answer colon then boxed later", "Answer:\n\nSo \\boxed{34}", ["34"]),
    ("empty Answer line then boxed", "Answer: \n\\boxed{34}", ["34"]),
    # stop tokens right after the answer (verl keeps the tag, SkyRL stops at '<')
] + [("Answer then stop token %s" % s, "Answer: 34" + s, ["34"]) for s in STOPS] + [
    ("Answer, space, stop token", "Answer: 34 <|user|>", ["34"]),
    ("Answer, stop token, another Answer", "Answer: 34<|user|>\nAnswer: 35", ["34", "35"]),
    ("Answer, stop token, new turn", "Answer: 34<|endoftext|>\nUser: thanks", ["34"]),
    ("boxed then stop token", "So \\boxed{34}<|endoftext|>", ["34"]),
    ("less-than inside the answer", "Answer: x<3", ["x<3", "3"]),
    # units, separators, LaTeX
    ("degrees symbol", "Answer: 34^\\circ", ["34"]),
    ("square units", "Answer: 34 square units", ["34"]),
    ("mph", "Answer: 34 mph", ["34"]),
    ("inches", "Answer: 34 inches", ["34"]),
    ("cm squared", "Answer: 34 cm^2", ["34"]),
    ("percent word", "Answer: 34 percent", ["34"]),
    ("dollar sign", "Answer: \\$34", ["34"]),
    ("braced comma thousands", "Answer: 1{,}000", ["1000"]),
    ("thin space thousands", "Answer: 1\\,000", ["1000"]),
    ("misplaced comma", "Answer: 10,00", ["1000"]),
    ("million", "Answer: 1,000,000", ["1000000"]),
    ("period thousands", "Answer: 1.000", ["1000"]),
    ("dfrac", "Answer: \\dfrac{1}{2}", ["\\frac{1}{2}", "\\dfrac{1}{2}"]),
    ("a/b", "Answer: 1/2", ["\\frac{1}{2}", "1/2"]),
    ("sqrt", "Answer: \\sqrt{2}", ["\\sqrt{2}", "\\sqrt2"]),
    ("pi", "Answer: 2\\pi", ["2\\pi"]),
    ("ordered pair with spaces", "Answer: (1, 2)", ["(1,2)"]),
    ("choice letter", "Answer: (A)", ["A", "(A)"]),
    ("text choice", "Answer: \\text{(A)}", ["(A)"]),
    ("nested boxed on the Answer line", "Answer: \\boxed{\\boxed{34}}", ["34"]),
    ("boxed frac of sqrt on the Answer line", "Answer: \\boxed{\\frac{\\sqrt{2}}{2}}", ["\\frac{\\sqrt{2}}{2}"]),
    # zero-padded golds
    ("padded gold 007", "Answer: 7", ["007", "7"]),
    ("padded answer 007", "Answer: 007", ["007", "7"]),
    ("zero", "Answer: 0", ["0", "000"]),
    ("negative padded", "Answer: -7", ["-007", "-7"]),
    ("boxed only, padded answer", "So the result is \\boxed{007}", ["7", "007"]),
    # the \boxed{} fallback: raw text, last 100 characters
    ("boxed only, units", "So the result is \\boxed{34 \\text{ cm}}", ["34"]),
    ("boxed only, thousands", "So the result is \\boxed{1,000}", ["1000", "1,000"]),
    ("boxed only, dollars", "So the result is \\boxed{$34$}", ["34"]),
    ("boxed only, nested", "So \\boxed{\\boxed{34}}", ["34", "\\boxed{34}"]),
    ("boxed only, frac of sqrt", "So \\boxed{\\frac{\\sqrt{2}}{2}}", ["\\frac{\\sqrt{2}}{2}"]),
    ("boxed only, unclosed", "So \\boxed{34", ["34"]),
    ("boxed then Answer", "\\boxed{12}\nAnswer: 34", ["34", "12"]),
] + [("boxed only, then %d characters" % k, clip_edge("\\boxed{34}", k), ["34"]) for k in (89, 90, 91)] + [
    # long reasoning and the 300-character clip
    ("long reasoning then Answer", REASONING + "Answer: 34", ["34"]),
    ("Answer then long reasoning", "Answer: 34\n" + REASONING, ["34", "48"]),
    ("Answer cut to its tail", "Answer: 12345\n" + "x" * 292, ["12345", "45"]),
    ("right Answer cut, wrong kept", "Answer: 34\n" + REASONING + "Answer: 35\n" + "y" * 100, ["34", "35"]),
] + [("Answer then %d filler characters" % k, clip_edge("Answer: 34\n", k), ["34"]) for k in (288, 289, 290, 291)] + [
    ("Answer then %d multibyte characters" % k, clip_edge("Answer: 34\n", k, "\u6570"), ["34"]) for k in (289, 290)]

# worked solutions as models write them, and padding tokens decoded after the answer
JANET = ("Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs a day.\n"
         "She makes 9 * 2 = $<<9*2=18>>18 every day at the farmer\u2019s market.\n")
GSM8K_MORE += [
    ("worked solution with calculator annotations", JANET + "#### 18", ["18", "9"]),
    ("worked solution, answer without ####", JANET + "The answer is 18.", ["18", "9"]),
    ("worked solution then the next question", JANET + "#### 18\n\nQuestion: A robe takes 2 bolts.", ["18", "2"]),
    ("The answer is: N", "The answer is: 18", ["18"]),
    ("boxed in a sentence", "Therefore, the answer is $\\boxed{18}$.", ["18"]),
    ("bare number", "18", ["18", "18.0"]),
    ("#### repeated", "#### 18\n\n#### 18", ["18"]),
    ("#### no space, unit", "####18 dollars", ["18"]),
    ("#### with an expression", "#### 18 - 2 = 16", ["18", "16"]),
    ("#### with a note", "#### 16 (18 - 2)", ["16", "2"]),
    ("#### dollar then minus", "#### $-18", ["-18"]),
    ("#### minus then dollar", "#### -$18", ["-18"]),
    ("#### negative with cents", "#### -18.75", ["-18.75"]),
    ("#### two periods", "#### 18.5.3", ["18.5.3", "18.5"]),
    ("#### exponent", "#### 1e3", ["1000", "1"]),
    ("#### fraction", "#### 3/4", ["0.75", "3"]),
    ("#### comma between digits", "#### 1,8", ["18"]),
    ("#### no-break space after", "#### 18\u00a0", ["18"]),
    ("#### carriage return", "#### 18\r\n", ["18"]),
    ("full-width hashes", "\uff03\uff03\uff03\uff03 18", ["18"]),
    ("Chinese reasoning then ####", "\u6570\u5b66 " * 150 + "#### 18", ["18"]),
    ("#### then padding tokens past the clip", "#### 18" + "<|endoftext|>" * 30, ["18"]),
    ("#### then padding tokens inside the clip", "#### 18" + "<|endoftext|>" * 20, ["18"]),
    ("#### then 74 </s>", "#### 18" + "</s>" * 74, ["18"]),
    ("#### then 73 </s>", "#### 18" + "</s>" * 73, ["18"]),
    ("think block with a wrong #### then the answer", "<think>maybe #### 17</think>\n#### 18", ["18", "17"]),
    ("LaTeX thousands", "#### 1{,}000", ["1000"]),
    ("LaTeX thin space thousands", "#### 1\\,000", ["1000"]),
    ("#### in a code block", "```\n#### 18\n```", ["18"]),
    ("#### after a markdown heading", "### Final answer\n#### 18", ["18"]),
]

MATH_MORE += [
    ("worked solution", "The cube has side 6, so its volume is $6^3 = \\boxed{216}$ cubic inches.", ["216", "6"]),
    ("boxed in an align block", "\\begin{align*} x &= \\boxed{3} \\end{align*}", ["3"]),
    ("boxed after a think block", "<think>maybe \\boxed{2}</think>\nSo \\boxed{3}.", ["3", "2"]),
]

DAPO_MORE += [
    ("worked solution with Answer", "We have $a + b + c = 34$.\n\nAnswer: 34", ["34", "33"]),
    ("Answer with spaces and a trailing period", "Answer:   34 .", ["34"]),
    ("Answer in a think block only", "<think>Answer: 34</think>", ["34"]),
    ("think block then Answer", "<think>Answer: 12</think>\nAnswer: 34", ["34", "12"]),
    ("Answer: with an expression", "Answer: 2 + 32 = 34", ["34"]),
    ("Answer with a text unit word", "Answer: 34 \\text{ units}", ["34"]),
    ("Answer then padding tokens", "Answer: 34" + "<|endoftext|>" * 30, ["34"]),
    ("Answer as a markdown item", "- Answer: 34", ["34"]),
    ("Answer with thousands and dollars", "Answer: \\$1,000", ["1000"]),
    ("Answer big integer with commas", "Answer: 12,345,678,901,234,567,890", ["12345678901234567890"]),
]

GSM8K_MORE += [
    ("#### then stop token then digits", "#### 18<|user|>7", ["18", "7"]),
    ("#### then a sentence with a number", "#### 18\nThat is 2 more than 16.", ["18", "16"]),
    ("#### with a trailing period and newline", "#### 18.\n", ["18", "18."]),
    ("#### with dollar and cents", "#### $18.50", ["18.50", "18.5"]),
    ("#### big number", "#### 109200000", ["109200000", "109,200,000"]),
    ("Answer: then ####", "Answer: 17\n#### 18", ["18", "17"]),
    ("#### then Answer:", "#### 18\nAnswer: 17", ["18", "17"]),
    ("#### then boxed", "#### 18\n\\boxed{17}", ["18", "17"]),
    ("#### with spaces around", "   ####   18   ", ["18"]),
    ("#### negative thousands", "#### -1,000", ["-1000"]),
    ("#### then percent sign and period", "#### 50%.", ["50"]),
    ("#### in parentheses", "(#### 18)", ["18"]),
]

MATH_MORE += [
    ("boxed, then stop token and padding", "\\boxed{216}" + "<|endoftext|>" * 30, ["216"]),
    ("boxed with text and number", "\\boxed{\\text{5 apples}}", ["5", "\\text{5apples}"]),
]

DAPO_MORE += [
    ("Answer with a padded stop token run", "Answer: 034</s></s>", ["034", "34"]),
    ("Answer lower case then stop token", "answer: 34<|im_end|>", ["34"]),
    ("Answer then boxed on the next line", "Answer: 12\n\\boxed{34}", ["34", "12"]),
    ("boxed only with Answer word earlier and no colon", "The answer \\boxed{34}", ["34"]),
]

GSM8K_CASES += expand(GSM8K_MORE)
MATH_CASES += expand(MATH_MORE)
DAPO_CASES += expand(DAPO_MORE)

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
