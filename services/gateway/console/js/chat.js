// A chat's view: its history, its live run(s), the question form and the message box.
//
// No duplicates between history and stream: the run named by the chat's `running_id` (running
// or paused), or the run this page just started, is shown from its stream from frame 0, and the
// history leaves out that run's messages but what no frame carries (its user message, and the
// answer to the question it resumed from). A run's replies are stored only when it ends, so
// nothing of it is lost or shown twice, also when it ends between GET chat and the listen.

import { ApiError } from "./api.js";
import { h, notice, text } from "./dom.js";
import { refusal } from "./chats.js";
import { renderHistory } from "./history.js";
import { questionForm } from "./questions.js";
import { RunView } from "./run.js";

export { renderChats } from "./chats.js";

// A turn this page started for a new chat, handed to the chat's view after the navigation.
let justStarted = null;
// A notice for the chat's view loaded again ({chatId, text}), shown once.
let carried = null;

const BUSY = {
  running: ["running", "running", "A run is going: wait for it or cancel it."],
  awaiting: ["awaiting", "awaiting input", "Answer the question above (or skip it, or cancel)."],
};

/** One chat (or a new one when `chatId` is null). */
export function renderChat(root, ctx, chatId) {
  const view = new ChatView(root, ctx, chatId);
  view.open();
  return () => view.close();
}

/** A line of the conversation written by the user: `who` above `text`. */
function userLine(who, text, extra = "") {
  return h(
    "div",
    { class: `message user ${extra}`.trim() },
    h("div", { class: "msg-who" }, who),
    h("div", { class: "text" }, text),
  );
}

class ChatView {
  constructor(root, ctx, chatId) {
    Object.assign(this, { root, ctx, chatId, api: ctx.api });
    this.controller = new AbortController();
    this.runs = new Set();
    this.asked = new Set(); // request ids whose form was shown (a question shows once)
    this.busy = null; // "running" | "awaiting" | null
    this.title = h("h1", { class: "grow chat-title" }, chatId ? "Chat" : "New chat");
    this.state = h("span", { class: "badge chat-state" }, chatId ? "…" : "new");
    this.cancelButton = h(
      "button",
      { type: "button", class: "danger cancel-run", hidden: true },
      "Cancel run",
    );
    this.cancelButton.addEventListener("click", () => this.cancel());
    this.notices = h("div", { class: "chat-notices" });
    this.older = h("div", { class: "older" });
    this.history = h("div", { class: "history" });
    this.live = h("div", { class: "live" });
    this.questionSlot = h("div", { class: "question-slot" });
    this.composer = this.buildComposer();
  }

  buildComposer() {
    this.input = h("textarea", {
      class: "composer-input",
      rows: "3",
      placeholder: "Message the assistant…",
    });
    this.send = h("button", { type: "submit", class: "send" }, "Send");
    this.hint = h("span", { class: "hint composer-hint" });
    const row = h("div", { class: "row" }, this.hint, h("span", { class: "grow" }), this.send);
    const form = h("form", { class: "composer card" }, this.input, row);
    form.addEventListener("submit", (event) => {
      event.preventDefault();
      this.sendMessage();
    });
    this.input.addEventListener("keydown", (event) => {
      if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) form.requestSubmit();
    });
    return form;
  }

  open() {
    this.root.append(
      h("a", { href: "#/chats", class: "back" }, "← Chats"),
      h("div", { class: "row page-head" }, this.title, this.state, this.cancelButton),
      this.notices,
      h(
        "div",
        { class: "conversation card" },
        this.older,
        this.history,
        this.live,
        this.questionSlot,
      ),
      this.composer,
    );
    if (this.chatId) this.load();
    else this.setBusy(null);
    this.input.focus();
  }

  close() {
    this.controller.abort();
    for (const run of this.runs) run.stop();
  }

  setBusy(busy) {
    this.busy = busy;
    const [cls, text, hint] = BUSY[busy] || ["ended", this.chatId ? "idle" : "new", ""];
    this.state.className = `badge chat-state ${cls}`;
    this.state.textContent = text;
    this.cancelButton.hidden = !busy;
    this.send.disabled = Boolean(busy);
    this.hint.textContent = hint || "Ctrl+Enter sends.";
  }

  async load() {
    let chat;
    try {
      const path = `/assistant/chat/${encodeURIComponent(this.chatId)}`;
      chat = await this.api.get(path, {}, this.controller.signal);
    } catch (error) {
      if (this.controller.signal.aborted) return;
      this.notices.append(notice("error", refusal(error)));
      if (error instanceof ApiError && error.status === 404) {
        // no such chat: nothing to send a message to
        this.composer.hidden = true;
        this.state.textContent = "not found";
      }
      return;
    }
    this.title.replaceChildren(chat.title ? text(chat.title) : "(untitled)");
    if (carried && carried.chatId === this.chatId) this.notices.append(notice("info", carried.text));
    carried = null;
    const hint = justStarted && justStarted.chatId === this.chatId ? justStarted.runId : null;
    justStarted = null;
    const attach = chat.running_id || hint;
    renderHistory(this, chat, attach);
    const pending = chat.pending_user_input_request;
    this.setBusy(null);
    if (attach) this.follow(attach);
    if (pending) {
      this.setBusy("awaiting");
      this.showQuestion(pending);
    }
  }

  /** Show run `runId` from its stream, below what is shown. */
  follow(runId) {
    const run = new RunView(this.api, this.chatId, runId, {
      onQuestion: (request) => {
        this.setBusy("awaiting");
        this.showQuestion(request);
      },
      onResumed: (newRunId) => {
        this.questionSlot.replaceChildren();
        this.follow(newRunId);
      },
      onReload: () => this.ctx.navigate(window.location.hash),
      onEnd: (kind) => this.runEnded(run, kind),
    });
    this.runs.add(run);
    this.live.append(run.el);
    this.setBusy("running");
    run.start();
    return run;
  }

  /** A run's stream ended with `kind`: the chat's state follows. */
  runEnded(run, kind) {
    if (kind === "interrupted") {
      this.setBusy("awaiting");
      return;
    }
    this.runs.delete(run);
    if (kind === "cancelled") this.questionSlot.replaceChildren();
    if (kind === "cancelled" || ![...this.runs].some((r) => !r.ended)) this.setBusy(null);
  }

  /** The form of question `request` (once per request id). */
  showQuestion(request) {
    if (!request || this.asked.has(request.request_id)) return;
    this.asked.add(request.request_id);
    const form = questionForm(this.api, this.chatId, request, {
      onAnswered: (started, summary) => {
        this.pausedAnswered(summary);
        this.live.append(userLine("You answered", summary, "answer-message"));
        this.questionSlot.replaceChildren();
        this.follow(started.run_id);
        this.input.focus(); // the answered form is gone: the focus goes on to the message box
      },
      onConflict: () => this.answeredElsewhere(),
    });
    this.questionSlot.replaceChildren(form);
  }

  /** The paused runs shown are answered (`summary`): each says so and stops watching. */
  pausedAnswered(summary) {
    for (const run of this.runs) {
      if (run.ended !== "interrupted") continue;
      run.answered(summary);
      this.runs.delete(run);
    }
  }

  /** The resume was refused with 409: the question was answered (or the run cancelled) in
   * another tab or client. The chat's view is loaded again (GET chat: its history and the run
   * now going, followed from its stream) under a notice saying so. */
  answeredElsewhere() {
    carried = { chatId: this.chatId, text: "This question was answered elsewhere (another tab or client)." };
    this.ctx.navigate(window.location.hash);
  }

  async sendMessage() {
    const message = this.input.value;
    if (!message.trim()) return;
    this.notices.replaceChildren();
    this.send.disabled = true;
    let started;
    try {
      const body = this.chatId ? { message, chat_id: this.chatId } : { message };
      started = await this.api.post("/assistant/chat", body);
    } catch (error) {
      this.notices.append(notice("error", refusal(error)));
      this.send.disabled = Boolean(this.busy);
      return;
    }
    this.input.value = "";
    if (!this.chatId) {
      justStarted = { chatId: started.chat_id, runId: started.run_id };
      // the chat's page replaces the empty one in the history: Back leaves the chat
      this.ctx.navigate(`#/chat/${encodeURIComponent(started.chat_id)}`, { replace: true });
      return;
    }
    this.live.append(userLine("You", message));
    this.follow(started.run_id);
  }

  async cancel() {
    this.cancelButton.disabled = true;
    try {
      await this.api.post(`/assistant/chat/${encodeURIComponent(this.chatId)}/cancel`);
      if (this.busy === "awaiting") {
        // a paused run's stream has ended: its `cancelled` is not streamed to us again
        const paused = [...this.runs].filter((run) => run.ended === "interrupted");
        for (const run of this.runs) run.stop();
        for (const run of paused) run.cancelledWhilePaused();
        this.runs.clear();
        this.questionSlot.replaceChildren();
        if (!paused.length) {
          const words = "Cancelled (the question was withdrawn).";
          this.live.append(h("p", { class: "notice info cancelled" }, words));
        }
        this.setBusy(null);
      }
    } catch (error) {
      this.notices.append(notice("error", refusal(error)));
    }
    this.cancelButton.disabled = false;
  }
}
