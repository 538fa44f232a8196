// One run of a chat, streamed live: its text, tool cards, notices, usage and raw frames.
//
// Frames are counted as the server counts them for ?after=N (heartbeats not), so a dropped
// connection is resumed with ?after=<count> and no frame is shown twice or lost. An `error`
// is held until the next frame: the run's own error is followed by `done {error: true}`,
// while the gateway's "The event stream was interrupted" error (not one of the run's frames)
// is followed by the end of the stream; that one is neither counted nor shown as a failure.

import { ApiError } from "./api.js";
import { h, notice, pretty, text, when } from "./dom.js";

const BACKOFF_MS = [300, 1000, 2000, 4000];
// reconnections in a row that bring no frame before the run's stream counts as lost
const MAX_ATTEMPTS = 10;
// how often a run paused on a credential question is listened to again for run_resumed
const WATCH_MS = 2000;
const END_BADGES = {
  done: ["ok", "done"],
  failed: ["failed", "failed"],
  cancelled: ["failed", "cancelled"],
  interrupted: ["awaiting", "awaiting input"],
  lost: ["failed", "stream lost"],
};

/** Sleep `ms` unless `signal` aborts first (then resolves early). */
function pause(ms, signal) {
  return new Promise((resolve) => {
    const timer = setTimeout(resolve, ms);
    const stop = () => {
      clearTimeout(timer);
      resolve();
    };
    signal.addEventListener("abort", stop, { once: true });
  });
}

/** A tool call's card: opens to its input and, once it arrives, its output (failed ones
 * marked). `card.setResult(output)` fills it; `card.setPending(text)` labels a call waiting. */
export function toolCard(name, input) {
  const state = h("span", { class: "badge running" }, "running");
  const output = h("pre", { class: "tool-output" }, "(no result yet)");
  const card = h(
    "details",
    { class: "tool-card" },
    h(
      "summary",
      {},
      h("span", { class: "tool-label" }, "tool"),
      h("code", { class: "tool-name" }, String(name ?? "")),
      state,
    ),
    h("div", { class: "tool-part" }, "Input"),
    h("pre", { class: "tool-input" }, pretty(input)),
    h("div", { class: "tool-part" }, "Output"),
    output,
  );
  card.setResult = (value) => {
    const failed = Boolean(value && typeof value === "object" && value.success === false);
    output.textContent = pretty(value);
    card.classList.toggle("failed", failed);
    state.className = failed ? "badge failed" : "badge ok";
    state.textContent = failed ? "failed" : "ok";
  };
  card.setPending = (words, cls = "awaiting") => {
    state.className = `badge ${cls}`;
    state.textContent = words;
  };
  card.setAnswer = (summary) => {
    card.setPending("answered", "ok");
    output.textContent = `Answered: ${summary}`;
  };
  return card;
}

/** The usage of a run's `done` frame as one line. */
export function usageLine(usage) {
  const u = usage || {};
  const n = (v) => (typeof v === "number" ? v.toLocaleString() : "?");
  const text =
    `Usage: ${n(u.input_tokens)} input · ${n(u.output_tokens)} output · ` +
    `${n(u.total_tokens)} total tokens · ${n(u.llm_calls)} LLM calls`;
  return h("div", { class: "usage" }, text);
}

export class RunView {
  /** Run `runId` of chat `chatId`. `hooks`: onQuestion(request, run), onResumed(newRunId),
   * onEnd(kind, run) with kind done, failed, cancelled, interrupted or lost, onReload(). */
  constructor(api, chatId, runId, hooks = {}) {
    Object.assign(this, { api, chatId, runId, hooks });
    this.count = 0; // the run's frames received (heartbeats and gateway notices not counted)
    this.ended = null;
    this.controller = new AbortController();
    this.cards = new Map();
    this.text = null;
    this.finalText = "";
    this.status = h("span", { class: "badge running run-status" }, "connecting");
    this.rawList = h("ol", { class: "raw-list" });
    this.rawCount = h("span", {}, "0");
    this.body = h("div", { class: "run-body" });
    const head = h(
      "div",
      { class: "run-head row" },
      h("span", { class: "muted" }, "run"),
      h("code", { class: "mono" }, runId),
      this.status,
    );
    const raw = h(
      "details",
      { class: "raw-frames" },
      h("summary", {}, "Raw frames (", this.rawCount, ")"),
      this.rawList,
    );
    this.el = h("section", { class: "run", dataset: { runId } }, head, this.body, raw);
  }

  setStatus(kind, text) {
    this.status.className = `badge run-status ${kind}`;
    this.status.textContent = text;
  }

  /** Note a frame's raw text in the raw panel; `mark` labels frames that are not the run's. */
  logRaw(raw, mark) {
    const item = h("li", { class: mark ? `raw-frame ${mark.kind}` : "raw-frame" });
    if (mark) item.append(h("span", { class: "raw-mark" }, mark.text));
    item.append(h("pre", {}, raw));
    this.rawList.append(item);
    this.rawCount.textContent = String(this.rawList.querySelectorAll(".raw-frame").length);
  }

  stop() {
    this.controller.abort();
  }

  /** The cards still waiting (running, or waiting for an answer), each given `change(card)`. */
  eachOpenCard(change) {
    for (const card of this.cards.values()) {
      if (card.querySelector(".badge.running, .badge.awaiting")) change(card);
    }
  }

  /** The paused run's question was answered (`summary`, here or elsewhere): the run stops
   * watching and says so, its question's card holds the answer. */
  answered(summary) {
    this.stop();
    this.eachOpenCard((card) => card.setAnswer(summary));
    this.setStatus("ok", "answered");
    for (const note of this.body.querySelectorAll(".paused-note")) note.textContent = "Answered.";
  }

  /** The paused run was cancelled from this page (its stream has ended: no `cancelled` frame
   * comes to us): the notice goes into the run, as a streamed one would. */
  cancelledWhilePaused() {
    this.stop();
    this.eachOpenCard((card) => card.setPending("cancelled", "failed"));
    this.body.append(h("p", { class: "notice info cancelled" }, "Cancelled (the question was withdrawn)."));
    this.setStatus("failed", "cancelled");
  }

  /** Read the stream to its end, reconnecting with ?after=N when it drops. */
  async start() {
    const signal = this.controller.signal;
    let attempt = 0;
    while (!this.ended && !signal.aborted) {
      const before = this.count;
      const held = await this.readOnce(signal);
      if (held) {
        // the stream ended right after an `error` without `done`: the gateway lost its upstream
        const text = "the gateway's notice, not a run frame (not counted)";
        this.logRaw(held.raw, { kind: "gateway", text });
      }
      if (this.ended || signal.aborted) return;
      attempt = this.count > before ? 0 : attempt + 1;
      if (attempt > MAX_ATTEMPTS) {
        this.lost();
        return;
      }
      this.setStatus("awaiting", "reconnecting…");
      this.rawList.append(h("li", { class: "raw-note" }, `reconnecting with ?after=${this.count}`));
      await pause(BACKOFF_MS[Math.min(attempt, BACKOFF_MS.length - 1)], signal);
    }
  }

  /** One listen from ?after=count until the stream ends, the run ends or the connection fails;
   * gives the `error` frame the stream ended on, if it did (null otherwise). */
  async readOnce(signal) {
    let held = null; // an `error` frame waiting to learn whether it is the run's
    this.setStatus("running", this.count ? "streaming" : "connecting");
    try {
      const frames = this.api.listen(this.chatId, this.runId, { after: this.count, signal });
      for await (const frame of frames) {
        this.setStatus("running", "streaming");
        const type = frame.event && frame.event.type;
        if (type === "heartbeat") {
          this.logRaw(frame.raw, { kind: "heartbeat", text: "heartbeat (not counted)" });
          continue;
        }
        if (held) this.accept(held);
        held = type === "error" ? frame : null;
        if (!held) this.accept(frame);
        if (this.ended) return null;
      }
    } catch (error) {
      if (signal.aborted) return null;
      if (error instanceof ApiError && error.status < 500 && error.status !== 429) {
        const text = `The stream was refused (${error.status}): ${error.detail}`;
        this.body.append(notice("error", text));
        this.finish("lost");
        return null;
      }
    }
    return held;
  }

  /** Give up after MAX_ATTEMPTS silent reconnections: say so and offer to load the chat again. */
  lost() {
    const reload = h("button", { type: "button", class: "secondary" }, "Load the chat again");
    if (this.hooks.onReload) reload.addEventListener("click", () => this.hooks.onReload());
    const text = "The stream cannot be reached.";
    this.body.append(h("div", { class: "notice error row" }, text, reload));
    this.finish("lost");
  }

  /** One of the run's frames: count it, log it and show it. */
  accept(frame) {
    this.count += 1;
    this.logRaw(frame.raw);
    const event = frame.event || {};
    const data = event.data && typeof event.data === "object" ? event.data : {};
    const show = RENDER[event.type] || RENDER.unknown;
    show.call(this, data, event, frame);
  }

  /** Append streamed text to the current answer block (a new one after a tool card). */
  addText(chunk) {
    if (!this.text) {
      this.text = h("div", { class: "answer" });
      this.body.append(this.text);
    }
    this.text.append(document.createTextNode(String(chunk ?? "")));
    this.finalText += String(chunk ?? "");
  }

  finish(kind) {
    this.ended = kind;
    if (kind === "lost") this.eachOpenCard((card) => card.setPending("unknown (stream lost)", "failed"));
    const [cls, text] = END_BADGES[kind] || ["", kind];
    this.setStatus(cls, text);
    if (this.hooks.onEnd) this.hooks.onEnd(kind, this);
  }

  /** After a pause on a credential question: listen again from the last frame every few
   * seconds for the run_resumed the OAuth2 callback appends (or a cancel), until stopped. */
  async watchForResume() {
    const signal = this.controller.signal;
    while (!signal.aborted) {
      await pause(WATCH_MS, signal);
      if (signal.aborted) return;
      try {
        const frames = this.api.listen(this.chatId, this.runId, { after: this.count, signal });
        for await (const frame of frames) {
          const type = frame.event && frame.event.type;
          if (type === "heartbeat") continue;
          this.accept(frame);
          if (type === "run_resumed" || type === "cancelled") return;
        }
      } catch {
        // a failed look is tried again at the next tick (or the view was closed)
      }
    }
  }

  /** A marked line in the run, e.g. guidance or an error: `label` in bold, then `words` (the
   * API's, in a bidirectional island). */
  marked(kind, label, words) {
    this.text = null;
    return this.body.appendChild(
      h("p", { class: `notice ${kind}` }, h("strong", {}, `${label}: `), text(words)),
    );
  }
}

// How each frame type shows; `this` is the RunView.
const RENDER = {
  metadata(data) {
    this.body.append(h("div", { class: "run-meta muted" }, `started ${when(data.timestamp)}`));
  },
  response_chunk(data) {
    this.addText(data.chunk);
  },
  tool_call(data) {
    const card = toolCard(data.tool, data.input);
    this.cards.set(data.tool_call_id, card);
    this.body.append(card);
    this.text = null;
  },
  tool_result(data) {
    let card = this.cards.get(data.tool_call_id);
    if (!card) {
      card = toolCard(data.tool, undefined);
      this.body.append(card);
    }
    card.setResult(data.output);
    this.text = null;
  },
  guidance(data) {
    this.marked("info guidance", "Guidance", data.message);
  },
  user_input_request(data) {
    this.marked("info question-asked", "Question", data.message);
    for (const card of this.cards.values()) {
      if (card.querySelector(".badge.running")) card.setPending("waiting for your answer");
    }
    this.question = data;
    if (this.hooks.onQuestion) this.hooks.onQuestion(data, this);
  },
  interrupted() {
    this.body.append(h("p", { class: "muted paused-note" }, "The run paused for your answer."));
    this.finish("interrupted");
    if (this.question && this.question.kind === "credential_request") this.watchForResume();
  },
  run_resumed(data) {
    this.body.append(notice("ok", "Resumed after the credential was connected."));
    this.setStatus("ok", "resumed");
    if (this.hooks.onResumed && data.new_run_id) this.hooks.onResumed(String(data.new_run_id));
  },
  error(data) {
    this.marked("error run-error", "Error", data.message ?? "the run failed").role = "alert";
    this.failed = true;
  },
  cancelled(data) {
    const reason = data.reason ? ` (${data.reason})` : "";
    this.body.append(h("p", { class: "notice info cancelled" }, `Cancelled${reason}.`));
    this.finish("cancelled");
  },
  done(data) {
    const response = typeof data.response === "string" ? data.response : "";
    if (!this.finalText && response) this.addText(response);
    this.body.append(usageLine(data.usage));
    this.finish(data.error || this.failed ? "failed" : "done");
  },
  unknown(data, event, frame) {
    const type = String(event.type ?? "unreadable");
    this.body.append(h("p", { class: "muted" }, `(${type} frame) `, h("code", {}, frame.raw)));
  },
};
