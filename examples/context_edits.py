"""GRPO over agents that edit their context: a group of reading agents with a context budget, trained exactly.

Each of G agents reads pages of a book with a ``read`` tool, looking for the page that holds a code word; all read
the same opening pages, then each its own. When its context passes ``--budget`` tokens an agent edits it: the even
ones evict their oldest pages down to half the budget (a placeholder says what was removed), the odd ones ask
themselves for a summary that replaces their turns so far. The episodes are logged token-exactly with their edits,
one exact GRPO backward of a tiny random-init hybrid model runs over every physical sequence they conditioned on,
sharing each common prefix, and the script prints the sharing: the tree's positions against the summed lengths of
the physical sequences (what training each sequence as its own sample evaluates). Run:

    python examples/context_edits.py --group 8 --pages 24 --budget 2048 --out runs/edits
    longstraw inspect runs/edits/trajectories.db --transcript
"""

import argparse
from pathlib import Path

import numpy as np

from longstraw_agents.chat import ChatFormatter
from longstraw_agents.models.presets import tiny_model
from longstraw_agents.store import Store
from longstraw_agents.tokenizer import load_tokenizer
from longstraw_agents.trainer import grpo_backward_trajectories
from longstraw_agents.trajectory import Trajectory

WORDS = "river stone lamp window orchard letter harbour candle meadow bridge lantern garden".split()


def page_text(book: np.random.Generator, page: int, code_page: int, words: int) -> str:
    text = " ".join(book.choice(WORDS, size=words))
    return f"Page {page}: {text}" + (" The code word is FALCON." if page == code_page else "")


def read_episode(fmt: ChatFormatter, pages: list[str], order: list[int], budget: int, summarise: bool) -> Trajectory:
    """One agent reading ``order`` until it meets the code word; edits its context whenever it passes ``budget``."""
    t = Trajectory(
        fmt.prompt(
            [
                {
                    "role": "system",
                    "content": "You read a book with the read tool. Answer with the page of the code word.",
                },
                {"role": "user", "content": f"The book has {len(pages)} pages. Which page holds the code word?"},
            ]
        )
    )
    found, turn = None, 0
    for turn, page in enumerate(order, start=1):
        if _context_tokens(t) > budget:
            _edit(fmt, t, turn, budget, summarise)
        t.append(fmt.assistant(f'<tool_call>{{"name": "read", "arguments": {{"page": {page}}}}}</tool_call>', turn))
        t.append(fmt.tool_observation([pages[page]], turn))
        if "FALCON" in pages[page]:
            found = page
            break
    t.append(fmt.assistant(f"<answer>{found if found is not None else 'unknown'}</answer>", turn + 1))
    t.reward, t.finish_reason = float(found is not None), "answered"
    return t


def _context_tokens(t: Trajectory) -> int:
    return t.num_tokens_of(t.context())


def _edit(fmt: ChatFormatter, t: Trajectory, turn: int, budget: int, summarise: bool) -> None:
    context, placeholders = t.context(), {edit.replacement for edit in t.edits}
    tools = [k for k in context if t.segments[k].role == "tool" and k not in placeholders]
    if not summarise:  # evict the oldest pages (and the calls between them) until half the budget is left
        start, end, size = context.index(tools[0]), context.index(tools[0]), _context_tokens(t)
        while size > budget // 2 and end < len(context) - 1:
            size -= len(t.segments[context[end]])
            end += 1
        removed = context[start:end]
        gone = [t.segments[k].text.split(":")[0].split()[-1] for k in removed if t.segments[k].role == "tool"]
        t.evict(removed, fmt.tool_observation([f"[pages {', '.join(gone)} removed from the context]"], turn))
        return
    t.append(fmt.observation("user", "Your context is full: summarise what you have read so far.", turn))
    read = [t.segments[k].text.split(":")[0].split()[-1] for k in tools]
    t.append(fmt.assistant(f"I have read pages {', '.join(read)}: no code word yet.", turn))
    first_turn = next(k for k in context if t.segments[k].role == "assistant")
    t.summarize(list(range(first_turn, len(t.segments))), len(t.segments) - 1)  # the summary stands for them
    t.append(fmt.observation("user", "Go on from your summary.", turn))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--pages", type=int, default=24)
    parser.add_argument("--reads", type=int, default=12, help="pages an agent reads before it must answer")
    parser.add_argument("--shared", type=int, default=2, help="opening pages every agent reads first")
    parser.add_argument("--words", type=int, default=120, help="words per page")
    parser.add_argument("--budget", type=int, default=2048, help="context tokens before an edit")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    fmt = ChatFormatter(load_tokenizer())
    rng = np.random.default_rng(args.seed)
    code_page = int(rng.integers(args.shared, args.pages))
    book = np.random.default_rng(args.seed + 1)
    pages = [page_text(book, p, code_page, args.words) for p in range(args.pages)]
    group = []
    for k in range(args.group):
        rest = rng.permutation(np.arange(args.shared, args.pages)).tolist()
        order = (list(range(args.shared)) + rest)[: args.reads]
        group.append(read_episode(fmt, pages, order, args.budget, summarise=k % 2 == 1))
    for t in group:
        t.group_id, t.env_id = "reading", "examples/context_edits"

    first = group[0]
    print(f"episode 0: {len(first.segments)} segments logged, {len(first.edits)} edits, reward {first.reward}")
    for seq in first.physical_sequences():
        print(
            f"  a physical sequence of {first.num_tokens_of(seq.segments):,} tokens "
            f"({len(seq.segments)} segments, {len(seq.own())} written under it)"
        )
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        with Store.open(args.out / "trajectories.db") as store:
            store.add_episodes(group)

    model = tiny_model("qwen3_5", vocab_size=fmt.tokenizer.vocab_size)
    stats = grpo_backward_trajectories(model, group, mode="exact", chunk_size=256)
    print(f"rewards {[t.reward for t in group]}")
    print(f"exact GRPO: loss {stats.loss:.4f} over {stats.loss_tokens:,} loss tokens of {stats.num_members} episodes")
    print(
        f"{stats.sequences} physical sequences, {stats.sequence_tokens:,} tokens in all; the tree evaluates "
        f"{stats.unique_tokens:,} positions ({stats.sequence_tokens / stats.unique_tokens:.1f}x fewer)"
    )


if __name__ == "__main__":
    main()
