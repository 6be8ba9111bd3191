"""The code-small section of docs/BENCHMARKS_<host>.md: the trained target measured.

Read from the suites the report chose (view, as in report_meaning): the e2e suite's
params["code_small"] (the training record of bench/weights.code_small_record, the prompts, the
sample continuation) and its records with model "code-small" (tau, accept-length histograms,
target forwards per token, wall-clock speedup over AR per budget and batch size); the service
suite's records with target "code-small". Nothing here is typed by hand; a figure the JSON does
not hold is shown as "-".
"""

from __future__ import annotations

from engine.remote.report_meaning import (_num, _rate, _src, e2e_device, e2e_find, e2e_records,
                                          service_records, service_rows)

MODEL = "code-small"
DRAFTER = "block:trained"
HIST_BINS = ((1, 1), (2, 2), (3, 3), (4, 4), (5, 5), (6, 8), (9, 12), (13, None))
GOAL_TAU, GOAL_SPEEDUP, GOAL_BUDGET = 4.0, 2.0, 63  # issue 16's goals


def hist_shares(hist) -> list:
    """Share of rounds per HIST_BINS bin of an accept-length histogram (hist[k]: rounds that
    accepted k tokens); [] when empty."""
    total = sum(hist or [])
    if not total:
        return []
    out = []
    for lo, hi in HIST_BINS:
        top = len(hist) - 1 if hi is None else min(hi, len(hist) - 1)
        out.append(sum(hist[lo:top + 1]) / total if lo < len(hist) else 0.0)
    return out


def _bin_label(lo, hi) -> str:
    return f"{lo}+" if hi is None else (str(lo) if lo == hi else f"{lo}-{hi}")


def _fence(text: str) -> str:
    """A code fence longer than any backtick run in text."""
    run, best = 0, 0
    for ch in text:
        run = run + 1 if ch == "`" else 0
        best = max(best, run)
    return "`" * max(3, best + 1)


def _training_lines(t: dict, toy: bool) -> list:
    secs = t.get("seconds")
    wall = secs.get("wall") if isinstance(secs, dict) else secs
    target_s = secs.get("target") if isinstance(secs, dict) else None
    out = [f"Training record (train.json{', **toy preset: the CI-sized version, not the trained target**' if toy else ''}): "
           f"preset `{t.get('config_name', '?')}`, {_num(t.get('parameters'), ',')} parameters "
           f"({_num(t.get('active_parameters'), ',')} active per token), byte-level BPE of "
           f"{t.get('vocab_size', '?')} ids; corpus {t.get('corpus_files', '?')} files of "
           f"`{t.get('corpus_root', '?')}` ({t.get('train_files', '?')} for training, "
           f"{t.get('heldout_files', '?')} held out by file), digest `{str(t.get('corpus_digest', '?'))[:16]}`; "
           f"{_num(t.get('steps'), ',')} steps, {_num(t.get('tokens_seen'), ',')} tokens seen at "
           f"{_num(t.get('tokens_per_second'), ',.0f')} tokens/s on {t.get('device', '?')} "
           f"({t.get('device_name', '?')}); the whole training {_num(wall, '.0f')} s"
           + (f" (the target {_num(target_s, '.0f')} s)" if target_s is not None else "") + "."]
    tr, ho, uni = t.get("train_loss"), t.get("heldout_loss"), t.get("unigram_heldout_loss")
    if isinstance(ho, (int, float)) and isinstance(uni, (int, float)):
        verdict = (f"**{uni - ho:.2f} nats below** the unigram model's" if ho < uni else
                   f"**not below** the unigram model's ({ho - uni:.2f} nats above)")
        out.append(f"- Loss, nats per token: train {_num(tr, '.3f')}, held-out {ho:.3f}, a "
                   f"unigram model of the training tokens on the held-out files {uni:.3f}: the "
                   f"held-out loss is {verdict}.")
    top1 = t.get("drafter_held_out_top1_by_depth")
    if top1:
        out.append(f"- Block drafter: {t.get('drafter_steps', '?')} steps against the target; "
                   "held-out top-1 accuracy by depth " + ", ".join(f"{x:.2f}" for x in top1[:8])
                   + (" ..." if len(top1) > 8 else "") + "; the training run's own tau estimate "
                   f"{_num(t.get('tau_estimate'), '.2f')}.")
    return out


def code_small_lines(view) -> list:
    """The section's markdown lines ([] when no chosen suite ran code-small)."""
    e2e = e2e_records(view, MODEL)
    svc = service_records(view, MODEL)
    p = ((view["suites"].get("e2e") or {}).get("params") or {}).get("code_small") or {}
    sp = ((view["suites"].get("service") or {}).get("params") or {}).get("code_small") or {}
    if not e2e and not svc:
        return []
    out = ["## code-small: a trained target", "",
           "`code-small` is a small MLA + MoE model of docs/MODEL.md's architecture trained on "
           "this host's Python standard library (split into training and held-out files; the "
           "prompts below come from held-out files only), with its block drafter trained "
           "against it (docs/TRAINING.md). Unlike `tiny`, its greedy continuations are code.", ""]
    training = p.get("training") or sp.get("training")
    if training:
        out += _training_lines(training, bool(p.get("toy"))) + [""]
    dev = e2e_device(view, MODEL)
    goals = {}
    if e2e and dev:
        batches = sorted({r["batch"] for r in e2e if r.get("backend") == dev})
        budgets = sorted({r.get("budget") for r in e2e if r.get("mode") == "ddtree"})
        pr = p.get("prompts") or {}
        out += [f"DDTree against AR on held-out prompts ({dev}, e2e{_src(view, 'e2e')}; "
                f"{pr.get('n', '?')} prompts of {_num(min(pr['lengths']), 'd') if pr.get('lengths') else '?'}-"
                f"{_num(max(pr['lengths']), 'd') if pr.get('lengths') else '?'} tokens, "
                f"{p.get('new_tokens', '?')} new tokens each; drafter {DRAFTER}): tau = mean "
                "acceptance length (tokens per round, the bonus token included), fwd/tok = target "
                "forwards per generated token, x AR = wall-clock speedup over AR:", "",
                "| budget | " + " | ".join(f"bs {b}: tau | bs {b}: fwd/tok | bs {b}: x AR" for b in batches)
                + " |", "|---|" + "--:|" * (3 * len(batches))]
        ar_cells = []
        for b in batches:
            ar = e2e_find(e2e, dev, b, "ar")
            ar_cells += ["1.00" if ar else "-", _num(_rate(ar, "target_forwards_per_token") if ar else None, ".3f"),
                         f"({_num(_rate(ar, 'tokens_per_s') if ar else None, '.0f')} tok/s)"]
        out.append("| AR | " + " | ".join(ar_cells) + " |")
        for budget in budgets:
            cells = []
            for b in batches:
                r = e2e_find(e2e, dev, b, "ddtree", budget, DRAFTER)
                tau, sp_ = (_rate(r, "mean_accept_length"), _rate(r, "speedup_vs_ar")) if r else (None, None)
                cells += [_num(tau, ".2f"), _num(_rate(r, "target_forwards_per_token") if r else None, ".3f"),
                          ("**" + _num(sp_, ".2f") + "**") if sp_ is not None and sp_ > 1 else _num(sp_, ".2f")]
                if budget == GOAL_BUDGET and b == 1:
                    goals["tau"], goals["speedup"] = tau, sp_
            out.append(f"| {budget} | " + " | ".join(cells) + " |")
        out.append("")
        bad = [r for r in e2e if not (r.get("validation") or {}).get("ok", True)]
        out.append(f"- AR == DDTree tokens on code-small: **{'NO' if bad else 'yes'}**, "
                   f"{len(e2e)} timed cases on {', '.join(sorted({r['backend'] for r in e2e}))}"
                   + (f"; first difference: {bad[0]['validation'].get('error')}" if bad else "") + ".")
        out.append("")
        hb = batches[0]
        rows = []
        for budget in budgets:
            r = e2e_find(e2e, dev, hb, "ddtree", budget, DRAFTER)
            shares = hist_shares((r or {}).get("accept_hist"))
            if shares:
                rows.append(f"| {budget} | " + " | ".join(f"{100 * x:.0f}%" for x in shares)
                            + f" | {_num(_rate(r, 'mean_accept_length'), '.2f')} |")
        if rows:
            out += [f"Accept lengths ({dev}, bs {hb}): the share of rounds that accepted k tokens "
                    "(bonus included), all prompts' rounds of the last timed sample:", "",
                    "| budget | " + " | ".join(f"k = {_bin_label(*b)}" for b in HIST_BINS) + " | tau |",
                    "|---|" + "--:|" * (len(HIST_BINS) + 1)] + rows + [""]
    if training or goals:
        ho, uni = (training or {}).get("heldout_loss"), (training or {}).get("unigram_heldout_loss")
        out += ["Issue 16's goals, as measured here:", "", "| what | goal | measured |", "|---|---|--:|",
                f"| trained drafter tau, budget {GOAL_BUDGET}, held-out prompts, bs 1 | >= {GOAL_TAU:g} | "
                f"{_num(goals.get('tau'), '.2f')} |",
                f"| DDTree vs AR wall clock, bs 1, budget {GOAL_BUDGET} | >= {GOAL_SPEEDUP:g}x | "
                f"{_num(goals.get('speedup'), '.2f')}x |",
                f"| held-out loss of the target (nats/token) | below unigram | "
                f"{_num(ho, '.3f')} vs {_num(uni, '.3f')} |", ""]
    if svc:
        rows = service_rows(svc, check=True)
        q = (view["suites"]["service"].get("params") or {})
        out += [f"Served (service{_src(view, 'service')}; text prompts of "
                f"{'-'.join(map(str, sp.get('prompt_tokens') or [])) or '?'} tokens from held-out files, "
                f"{q.get('requests', '?')} requests per level, {q.get('max_tokens', '?')} tokens each, "
                f"DDTree budget {q.get('budget', '?')}"
                + (f" shrunk while requests x (budget + 1) > {q['round_tokens']}" if q.get("round_tokens") else "")
                + "):", "", "| mode | concurrency | tok/s | vs AR | TTFT p50 | TTFT p99 | errors | tokens = engine's |",
                "|---|--:|--:|--:|--:|--:|--:|---|"] + rows + [""]
    s = p.get("sample")
    if s:
        fence = _fence((s.get("prompt_text") or "") + (s.get("ar_text") or ""))
        out += [f"A sample ({s.get('device')}, bs {s.get('batch')}, budget {s.get('budget')}, "
                f"{s.get('drafter')}): a held-out prompt of {len(s.get('prompt_ids') or [])} tokens and "
                f"its greedy continuation of {len(s.get('ar_ids') or [])} tokens; AR and DDTree "
                f"continuations identical: **{'yes' if s.get('identical') else 'NO'}**.", "",
                "Prompt:", "", fence, s.get("prompt_text") or "", fence, "",
                "Continuation (AR" + (" = DDTree" if s.get("identical") else "") + "):", "",
                fence, s.get("ar_text") or "", fence, ""]
        if not s.get("identical"):
            out += ["Continuation (DDTree):", "", fence, s.get("ddtree_text") or "", fence, ""]
    return out
