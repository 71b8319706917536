"""Training data from a tiny target: greedy continuations and auxiliary hidden states.

Runs the target with ``transformers`` (CPU, fp32): prompts (windows of the
tiny tokenizer's own text, and random token ids) are continued greedily, then
one forward pass over prompt + continuation gives, per token, the
concatenation of ``output_hidden_states[id + 1]`` for each DFlash
``target_layer_ids`` entry (the residual stream after that layer, before the
final norm): the context rows the target ships to the draft.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch

from k3_accel.testing.tiny import _TEXT, EOS_ID


@dataclass
class Group:
    """Sequences of one length: ``tokens [N, T]``, ``aux [N, T, A*H]``, the
    target's log-probabilities ``logp [N, T, V]`` (row t predicts token t+1);
    the first ``prompt_len`` tokens are the prompt."""
    tokens: torch.Tensor
    aux: torch.Tensor
    logp: torch.Tensor
    prompt_len: int

    def anchors(self, k: int) -> torch.Tensor:
        """Block anchors whose ``k`` labels are all generated tokens: the first
        generated position up to ``T - 1 - k``."""
        return torch.arange(self.prompt_len, self.tokens.shape[1] - k)


@dataclass
class TargetData:
    groups: list[Group]
    embed: torch.Tensor        # the target's embed_tokens [V, H]
    lm_head: torch.Tensor      # the target's lm_head [V, H]


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run torch on one CPU thread inside (tiny matrices gain little from more,
    and spinning OpenMP threads on a busy machine cost many times over)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def load_target(target_dir: str | Path):
    """The tiny target as a transformers model (eval, fp32), quietly."""
    import transformers
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return transformers.AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()


def prompts(target_dir: str | Path, vocab: int, length: int, count: int, gen: torch.Generator) -> torch.Tensor:
    """``[count, length]`` prompt ids: half windows of the tokenizer's text
    (when the target has a tokenizer), the rest random non-special ids."""
    windows = torch.empty(0, length, dtype=torch.long)
    tok_file = Path(target_dir) / "tokenizer.json"
    if tok_file.is_file():
        from tokenizers import Tokenizer
        text = torch.tensor(Tokenizer.from_file(str(tok_file)).encode(_TEXT).ids, dtype=torch.long)
        if len(text) > length:
            starts = torch.randint(0, len(text) - length, (count // 2,), generator=gen)
            windows = torch.stack([text[s:s + length] for s in starts.tolist()]) if len(starts) else windows
    rand = torch.randint(EOS_ID + 1, vocab - 1, (count - len(windows), length), generator=gen)
    return torch.cat([windows, rand])


@torch.no_grad()
def continue_greedily(model, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """``ids`` followed by ``new_tokens`` greedy tokens (EOS does not stop it)."""
    out = model(input_ids=ids, use_cache=True)
    seq = [ids, out.logits[:, -1].argmax(-1, keepdim=True)]
    for _ in range(new_tokens - 1):
        out = model(input_ids=seq[-1], past_key_values=out.past_key_values, use_cache=True)
        seq.append(out.logits[:, -1].argmax(-1, keepdim=True))
    return torch.cat(seq, dim=1)


@torch.no_grad()
def aux_hidden_states(model, tokens: torch.Tensor, layer_ids: Sequence[int]
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, T, len(layer_ids) * H]``: ``output_hidden_states[id + 1]``, concatenated
    in ascending order; and the target's log-probabilities ``[N, T, V]``."""
    out = model(input_ids=tokens, output_hidden_states=True)
    aux = torch.cat([out.hidden_states[i + 1] for i in sorted(layer_ids)], dim=-1)
    return aux, out.logits.log_softmax(-1)


def target_sequences(target_dir: str | Path, layer_ids: Sequence[int], prompt_lens: Sequence[int],
                     count: int, new_tokens: int, seed: int, chunk: int = 256) -> TargetData:
    """``count`` greedy continuations of ``new_tokens`` per prompt length, with aux states."""
    model = load_target(target_dir)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    groups = []
    for length in prompt_lens:
        ids = prompts(target_dir, vocab, length, count, gen)
        tokens = torch.cat([continue_greedily(model, c, new_tokens) for c in ids.split(chunk)])
        aux, logp = (torch.cat(x) for x in zip(*(aux_hidden_states(model, c, layer_ids)
                                                  for c in tokens.split(chunk))))
        groups.append(Group(tokens, aux, logp, length))
    return TargetData(groups, model.get_input_embeddings().weight.detach().clone(),
                      model.get_output_embeddings().weight.detach().clone())
