"""Train a tiny language model a few steps and push its weights to an engine in another process after each step.

Uses only torch and miles-sync. The engine process starts from different random weights, serves updates over the
shared-memory transport, then greedily generates from a prompt with whatever weights it holds; the trainer checks
that the engine's logits and tokens equal its own model's, bit for bit.

    uv run python examples/sync/train_and_push.py --steps 3
"""

import argparse
import logging

import torch
import torch.multiprocessing as mp
from miles.sync import WeightReceiver, WeightSender
from miles.sync.transports.shared_memory import SharedMemoryEndpoint, SharedMemoryTransport
from torch import Tensor, nn

logger = logging.getLogger("train_and_push")
VOCAB, DIM, CONTEXT = 16, 32, 12


class TinyLM(nn.Module):
    """Embedding -> one causal transformer layer -> LM head. tokens: [B, T] int64 -> logits [B, T, VOCAB] float32."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.position = nn.Parameter(torch.zeros(CONTEXT, DIM))
        self.block = nn.TransformerEncoderLayer(DIM, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: Tensor) -> Tensor:
        length = tokens.shape[1]
        causal = nn.Transformer.generate_square_subsequent_mask(length)
        hidden = self.embed(tokens) + self.position[:length]
        return self.head(self.block(hidden, src_mask=causal, is_causal=True))


@torch.no_grad()
def greedy(model: TinyLM, prompt: list[int], num_tokens: int) -> tuple[list[int], Tensor]:
    """Greedy decoding; returns the generated token ids and the logits [len(prompt) + num_tokens - 1, VOCAB]."""
    tokens = torch.tensor([prompt])
    for _ in range(num_tokens):
        logits = model(tokens)
        tokens = torch.cat([tokens, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return tokens[0, len(prompt) :].tolist(), logits[0]


def engine_main(conn, results, prompt: list[int], num_tokens: int) -> None:
    """Engine process: random weights until the first update; after each update, generate and report."""
    torch.set_num_threads(1)
    torch.manual_seed(1234)  # deliberately different from the trainer
    model = TinyLM().eval()
    params = dict(model.state_dict(keep_vars=True))

    @torch.no_grad()
    def load(named_tensors: list[tuple[str, Tensor]]) -> None:
        for name, tensor in named_tensors:
            params[name].copy_(tensor)

    receiver = WeightReceiver(apply_fn=load)
    endpoint = SharedMemoryEndpoint(receiver, conn)
    while endpoint.serve_update():
        tokens, logits = greedy(model, prompt, num_tokens)
        results.put((receiver.weight_version, tokens, logits.clone()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="training steps; weights are pushed after each")
    parser.add_argument("--codec", default="identity", help="miles.sync codec; only identity is exact")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    torch.set_num_threads(1)
    torch.manual_seed(0)

    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sequence = torch.arange(CONTEXT + 1) % 5  # learn to continue 0 1 2 3 4 0 1 ...
    prompt, num_tokens = [0, 1, 2], 6

    context = mp.get_context("spawn")
    sender_conn, engine_conn = context.Pipe()
    results = context.Queue()
    engine = context.Process(target=engine_main, args=(engine_conn, results, prompt, num_tokens))
    engine.start()
    transport = SharedMemoryTransport(sender_conn, timeout_s=60)
    sender = WeightSender(transport, codec=args.codec)
    mismatches = 0
    try:
        for step in range(args.steps):
            model.train()
            logits = model(sequence[None, :-1])
            loss = nn.functional.cross_entropy(logits[0], sequence[1:])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

            version = sender.push(model.state_dict().items())
            engine_version, engine_tokens, engine_logits = results.get(timeout=60)
            trainer_tokens, trainer_logits = greedy(model.eval(), prompt, num_tokens)
            same = engine_version == version and engine_tokens == trainer_tokens
            same = same and torch.equal(engine_logits, trainer_logits)
            mismatches += not same
            logger.info(
                "step %d loss %.4f -> weights v%d; engine tokens %s, trainer tokens %s: %s",
                step, loss.item(), version, engine_tokens, trainer_tokens, "match" if same else "MISMATCH",
            )  # fmt: skip
    finally:
        transport.close()
        engine.join(timeout=60)
    if mismatches:
        raise SystemExit(f"{mismatches} of {args.steps} updates left the engine different from the trainer")
    logger.info("engine matched the trainer after all %d updates", args.steps)


if __name__ == "__main__":
    main()
