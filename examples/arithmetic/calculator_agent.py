"""The multi-turn arithmetic agent: it asks the model for an expression, runs it through a
calculator tool, hands the tool's result back, and answers on the second turn. So every
trajectory spans several model calls (and the tool's text sits between them).

Like `agent.py` it knows DARL only through DARL_TASK and DARL_RESULT_URL.
Set AGENT_STREAM=1 to stream the answers.
"""

from __future__ import annotations

import ast
import json
import operator
import os
import re

from openai import OpenAI

from darl.examples.arithmetic.agent import final_answer, question_of, report

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calculate(expression: str) -> str:
    """A calculator tool: + - * on integers, nothing else (no eval)."""

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError("unsupported expression")

    match = re.search(r"[-\d][\d\s+*-]*\d|\d", expression)
    if match is None:
        return "error: no expression found"
    try:
        return str(value(ast.parse(match.group(0).strip(), mode="eval").body))
    except (SyntaxError, ValueError) as err:
        return f"error: {err}"


def ask(client: OpenAI, messages: list[dict], stream: bool) -> str:
    max_tokens = int(os.environ.get("AGENT_MAX_TOKENS", "12"))
    model = os.environ.get("OPENAI_MODEL", "policy")
    if not stream:
        completion = client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens
        )
        return completion.choices[0].message.content or ""
    chunks = client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, stream=True
    )
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def main() -> None:
    task = json.loads(os.environ["DARL_TASK"])
    question = question_of(task)
    stream = os.environ.get("AGENT_STREAM") == "1"
    client = OpenAI(max_retries=6)
    messages = [
        {"role": "system", "content": "Write the expression to compute, then answer."},
        {"role": "user", "content": question},
    ]
    expression = ask(client, messages, stream)
    tool_result = calculate(expression)
    messages += [
        {"role": "assistant", "content": expression},
        {"role": "user", "content": f"calculator: {tool_result}. Answer with the number only."},
    ]
    text = ask(client, messages, stream)
    answer = final_answer(text)
    print(f"expression {expression!r} -> {tool_result!r}; answer {answer!r}")
    report(answer, calls=2)


if __name__ == "__main__":
    main()
