"""Prompt templates (`data.template`) and chat rendering (`data.chat`).

A template turns a dataset's question into what the model is asked, in two forms: plain
text (`data.chat=false`) or chat messages (`data.chat=true`, rendered later with the
tokenizer's own chat template, where token ids are made). It also writes the reference
response in the shape it asks for (the SFT target) and says whether a generated response
has that shape (the format reward):

    plain  the question as is; answers end with "#### <answer>" (GSM8K's convention)
    boxed  asks for step-by-step reasoning and the final answer in \\boxed{}
    r1     a DeepSeek-R1-Zero style conversation: reasoning in <think> </think>, then the
           answer in <answer> </answer>
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from posttrain.data.answers import after_hash_marker, extract_final_answer, last_boxed_content
from posttrain.errors import ConfigError, DataError

CHAT_ROLES = ("system", "user", "assistant", "tool")

R1_INSTRUCTION = (
    "The user gives a problem and the assistant solves it. The assistant first works through its reasoning "
    "privately, then states the result. The reasoning goes inside <think> </think> tags and the final answer "
    "inside <answer> </answer> tags, like this: <think> reasoning </think> <answer> final answer </answer>."
)
R1_SHAPE = re.compile(r"\s*<think>.+?</think>\s*<answer>.+?</answer>\s*", re.DOTALL)


@dataclass(frozen=True)
class PromptTemplate:
    name: str
    user: Callable[[str], str]                 # question -> the user's message
    text: Callable[[str], str]                 # question -> the whole prompt as plain text
    response: Callable[[str, str], str]        # (reference solution, final answer) -> SFT target
    has_style: Callable[[str], bool]           # does a generated response have the asked shape
    system: str | None = None                  # the system message of the chat form
    end_of_thinking: str | None = None         # what closes the reasoning (posttrain-eval's thinking budget)

    def messages(self, question: str) -> list[dict]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return [*system, {"role": "user", "content": self.user(question)}]


def plain_response(solution: str, answer: str) -> str:
    if not solution:
        return answer
    marked = last_boxed_content(solution) is not None or after_hash_marker(solution) is not None
    return solution if marked else f"{solution}\n#### {answer}"


def boxed_user(question: str) -> str:
    return f"{question}\nReason step by step, then put your final answer within \\boxed{{}}."


def boxed_response(solution: str, answer: str) -> str:
    if last_boxed_content(solution) is not None:
        return solution  # MATH solutions box their answer already
    conclusion = f"The final answer is $\\boxed{{{answer}}}$."
    return f"{solution}\n{conclusion}" if solution else conclusion


def r1_text(question: str) -> str:
    return f"{R1_INSTRUCTION}\nUser: {question}\nAssistant:"


def r1_response(solution: str, answer: str) -> str:
    return f"<think>\n{solution}\n</think>\n<answer>{answer}</answer>"


def states_an_answer(response: str) -> bool:
    return extract_final_answer(response) is not None


TEMPLATES: dict[str, PromptTemplate] = {
    "plain": PromptTemplate("plain", user=lambda q: q, text=lambda q: q, response=plain_response,
                            has_style=states_an_answer),
    "boxed": PromptTemplate("boxed", user=boxed_user, text=boxed_user, response=boxed_response,
                            has_style=lambda r: last_boxed_content(r) is not None),
    "r1": PromptTemplate("r1", user=lambda q: q, text=r1_text, response=r1_response,
                         has_style=lambda r: R1_SHAPE.fullmatch(r) is not None, system=R1_INSTRUCTION,
                         end_of_thinking="</think>"),
}


def get_template(name: str) -> PromptTemplate:
    if name not in TEMPLATES:
        raise ConfigError(f"data.template={name!r} is not one of {sorted(TEMPLATES)}")
    return TEMPLATES[name]


def check_messages(messages, where: str) -> list[dict]:
    """``messages`` as a chat (a non-empty list of {role, content} with known roles), or a
    DataError naming ``where`` (the example) and what is wrong."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: a chat prompt must be a non-empty list of {{'role', 'content'}} messages, "
                        f"got {type(messages).__name__}")
    chat = []
    for number, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise DataError(f"{where}: message {number} must be an object with a string 'content', got {message!r:.100}")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise DataError(f"{where}: message {number} has role {role!r}, which is not a chat role; "
                            f"expected one of {list(CHAT_ROLES)}")
        chat.append({"role": role, "content": message["content"]})
    return chat


def last_user_content(messages: list[dict]) -> str:
    """The question of a chat: the last user message (what verifiers and sample logs read)."""
    return next((m["content"] for m in reversed(messages) if m["role"] == "user"), messages[-1]["content"])


def render_chat(messages: list[dict], tokenizer) -> str:
    """A chat prompt as the text the model continues: the tokenizer's chat template with the
    assistant's turn opened. Tokenise it without adding special tokens (the template wrote them)."""
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            f"the prompts are chat messages (data.chat=true, or prompts given as message lists in the data), but "
            f"the tokenizer of {getattr(tokenizer, 'name_or_path', None) or 'this model'!r} has no chat template "
            f"(a base model?); set data.chat=false to give prompts as plain text, or use a model with a chat "
            f"template")
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
