"""lm-evaluation-harness's model interface around our own model and the run's tokenizer.

Scoring runs through models/ directly (no HF export) so a reported log-likelihood is exactly
what our forward computes: every request is right-padded in a batch (causal attention makes
the padding invisible to earlier positions) and scored with an fp32 log-softmax. The context
conventions are lm-eval's TemplateLM ones, which its HF model class shares: an empty context is
conditioned on the EOS token (documents follow an EOS in our token streams), no BOS is added,
and a context longer than the model's window is cut from the left.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from evaluation.sampling import iter_sampled_tokens

# (cache key (context, continuation) or None, context ids, continuation ids)
TokenRequest = Tuple[Optional[Tuple[str, str]], List[int], List[int]]


class CheckpointLM(TemplateLM):
    """lm-eval LM for one of our CausalLM models; ``batch_size`` requests per forward."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, batch_size: int = 16,
                 max_gen_toks: int = 256, seed: int = 1234) -> None:
        super().__init__()
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = int(batch_size)
        self.max_gen_toks = int(max_gen_toks)
        self.seed = seed
        self._device = next(model.parameters()).device

    # --- what TemplateLM needs -----------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return int(self.tokenizer.eos_token_id)

    @property
    def max_length(self) -> int:
        return int(self.model.cfg.seq_len)

    @property
    def device(self) -> torch.device:
        return self._device

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, **kwargs) -> List[int]:
        # Pretraining streams carry no BOS: never add special tokens.
        return self.tokenizer.encode(string, add_special_tokens=False)

    def tok_decode(self, tokens: Sequence[int], **kwargs) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=False)

    @torch.no_grad()
    def _loglikelihood_tokens(self, requests: List[TokenRequest], disable_tqdm: bool = False,
                              **kwargs) -> List[Tuple[float, bool]]:
        # Longest first, so a batch pads little and the first batch shows the peak memory.
        order = sorted(range(len(requests)),
                       key=lambda i: -len(requests[i][1]) - len(requests[i][2]))
        answers: List[Optional[Tuple[float, bool]]] = [None] * len(requests)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start:start + self.batch_size]
            inputs, continuations = [], []
            for i in chunk:
                _, context, continuation = requests[i]
                if not continuation:
                    raise ValueError(f"an empty continuation cannot be scored (request {requests[i][0]!r})")
                # The last token is only predicted; keep at most max_length inputs, cut from the left.
                inputs.append((context + continuation)[-(self.max_length + 1):][:-1])
                continuations.append(continuation)
            width = max(len(x) for x in inputs)
            batch = torch.zeros((len(inputs), width), dtype=torch.long)
            for row, ids in enumerate(inputs):
                batch[row, :len(ids)] = torch.tensor(ids, dtype=torch.long)
            log_probs = F.log_softmax(self.model(batch.to(self.device)).float(), dim=-1)
            for row, i in enumerate(chunk):
                continuation = continuations[row]
                end = len(inputs[row])
                scores = log_probs[row, end - len(continuation):end]  # [len(cont), V]
                target = torch.tensor(continuation, dtype=torch.long, device=scores.device)
                total = float(scores.gather(1, target[:, None]).sum())
                greedy = bool((scores.argmax(dim=-1) == target).all())
                answers[i] = (total, greedy)
                if requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], answers[i])
        return answers  # type: ignore[return-value]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> List[float]:
        """Whole-document log-likelihoods (perplexity tasks): disjoint windows of max_length
        tokens, each conditioned on as much preceding text as fits, the first on the EOS."""
        results = []
        for request in requests:
            (text,) = request.args
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1)]
            scores = self._loglikelihood_tokens([(None, ctx, cont) for ctx, cont in windows])
            total = sum(score for score, _ in scores)
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
            results.append(total)
        return results

    @torch.no_grad()
    def generate_until(self, requests, disable_tqdm: bool = False) -> List[str]:
        """Greedy unless the task asks for sampling (do_sample / temperature > 0); stops at the
        first stop string (the EOS text is always one) or after max_gen_toks tokens."""
        eos_text = self.tok_decode([self.eot_token_id])
        generator = torch.Generator(device=self.device)
        generator.manual_seed(self.seed)
        outputs = []
        for request in requests:
            context, gen_kwargs = request.args
            gen_kwargs: Dict[str, Any] = dict(gen_kwargs or {})
            until = gen_kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            if eos_text not in until:
                until.append(eos_text)
            max_new = int(gen_kwargs.get("max_gen_toks", self.max_gen_toks))
            temperature = float(gen_kwargs.get("temperature", 0.0) or 0.0)
            if not gen_kwargs.get("do_sample", temperature > 0):
                temperature = 0.0
            top_k = gen_kwargs.get("top_k")
            budget = self.max_length - max_new
            if budget < 1:
                raise ValueError(f"max_gen_toks={max_new} leaves no room for a context in the "
                                 f"model's {self.max_length}-token window")
            prompt = (self.tok_encode(context) or [self.eot_token_id])[-budget:]
            new_tokens: List[int] = []
            text = ""
            for token in iter_sampled_tokens(self.model, prompt, max_new, temperature,
                                             int(top_k) if top_k else None, generator):
                new_tokens.append(token)
                text = self.tok_decode(new_tokens)
                if any(stop in text for stop in until):
                    break
            cut = min((text.index(s) for s in until if s in text), default=len(text))
            text = text[:cut]
            self.cache_hook.add_partial("generate_until", request.args, text)
            outputs.append(text)
        return outputs
