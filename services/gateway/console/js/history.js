// A chat's stored messages (GET /assistant/chat/{id}), oldest first, as text and tool cards.
//
// user and assistant messages show their text; an assistant message's tool calls become cards
// that the matching `tool` message fills with its output; a summary is marked (and guidance,
// should a system message carry it). Older pages (next_page_token) load on demand.

import { h, notice, pretty, text, when } from "./dom.js";
import { toolCard } from "./run.js";

const ENDED_BADGES = { failed: "failed", cancelled: "cancelled", expired: "expired" };

/** A message's content as text: strings as they are, anything else as JSON. */
function textOf(content) {
  return typeof content === "string" ? content : pretty(content);
}

/** A message block: `who` (a string or nodes) above the content's text. */
function block(cls, who, content, textClass = "text") {
  return h(
    "div",
    { class: `message ${cls}` },
    h("div", { class: "msg-who" }, who),
    h("div", { class: textClass }, textOf(content)),
  );
}

/** The elements of one user message: its time and, for a run that did not complete, a badge. */
function userMessage(m) {
  const ended = ENDED_BADGES[m.running_status];
  const badge = ended ? h("span", { class: "badge failed" }, `run ${ended}`) : null;
  const who = ["You", h("span", { class: "muted" }, when(m.created_at)), badge];
  return block("user", who, m.content);
}

/** A failed run's reason, which no stored message holds (GET chat and status give only
 * "failed"): the `error` frame of the run's stream, replayed from frame 0, under its message. */
function failureReason(view, runId) {
  const line = h("p", { class: "notice error run-error" }, h("strong", {}, "Error: "), "…");
  (async () => {
    let message = null;
    try {
      const frames = view.api.listen(view.chatId, runId, { signal: view.controller.signal });
      for await (const frame of frames) {
        const event = frame.event || {};
        if (event.type === "error" && event.data && event.data.message != null) {
          message = String(event.data.message);
        }
      }
    } catch {
      message = null; // the stream is gone (or the view): say only that the run failed
    }
    line.replaceChildren(h("strong", {}, "Error: "), message ? text(message) : "the run failed (no reason kept)");
  })();
  return line;
}

/** Elements for `messages`; `cards` maps tool_call_id -> card across a page. A failed run with
 * no message of its own in the page (a provider's error, a crash) gets its reason when `view`
 * is given. */
function messageElements(messages, cards, view = null) {
  const out = [];
  const runsWithReplies = new Set(messages.filter((m) => m.role !== "user").map((m) => m.run_id));
  for (const m of messages) {
    const thinking = m.thinking && typeof m.thinking === "object" ? m.thinking : {};
    if (m.role === "user") {
      out.push(userMessage(m));
      if (view && m.running_status === "failed" && m.run_id && !runsWithReplies.has(m.run_id)) {
        out.push(failureReason(view, m.run_id));
      }
    } else if (m.role === "assistant") {
      if (m.content) out.push(block("assistant", "Assistant", m.content, "text answer"));
      for (const call of Array.isArray(thinking.tool_calls) ? thinking.tool_calls : []) {
        const card = toolCard(call.name, call.input);
        cards.set(call.id, card);
        out.push(card);
      }
    } else if (m.role === "tool") {
      let card = cards.get(thinking.tool_call_id);
      if (!card) {
        card = toolCard(thinking.name, undefined);
        out.push(card);
      }
      card.setResult(m.content);
    } else if (m.role === "summary") {
      const head = [h("span", { class: "badge" }, "summary"), " of the earlier conversation"];
      const text = h("div", { class: "text" }, textOf(m.content));
      out.push(h("details", { class: "summary-message" }, h("summary", {}, head), text));
    } else if (m.role === "system" && thinking.guidance) {
      const label = h("strong", {}, "Guidance: ");
      out.push(h("p", { class: "notice info guidance" }, label, textOf(m.content)));
    } else {
      out.push(block("other muted", String(m.role ?? "?"), m.content));
    }
  }
  for (const card of cards.values()) {
    if (card.querySelector(".badge.running")) card.setPending("no result");
  }
  return out;
}

/** `messages` but those of run `attached`, which its stream shows, except what no frame of it
 * carries: its user message, and the answer to the question of the run it resumed (a `tool`
 * message of the attached run answering a call of an earlier run). */
function kept(messages, attached) {
  if (!attached) return messages;
  const earlierCalls = new Set();
  for (const m of messages) {
    const calls = m.run_id !== attached && m.thinking && m.thinking.tool_calls;
    if (Array.isArray(calls)) for (const call of calls) earlierCalls.add(call.id);
  }
  return messages.filter(
    (m) =>
      m.run_id !== attached ||
      m.role === "user" ||
      (m.role === "tool" && m.thinking && earlierCalls.has(m.thinking.tool_call_id)),
  );
}

/** Fill `view.history` with `chat`'s messages, leaving out those run `attached`'s stream
 * shows (`kept`). */
export function renderHistory(view, chat, attached) {
  const messages = kept(chat.messages || [], attached);
  view.history.replaceChildren(...messageElements(messages, new Map(), view));
  if (!messages.length && !attached) {
    view.history.append(h("p", { class: "muted" }, "No messages yet."));
  }
  olderButton(view, chat.next_page_token, attached);
}

/** "Load older messages" for `token`, prepending the page it gets. */
function olderButton(view, token, attached) {
  view.older.replaceChildren();
  if (!token) return;
  const button = h("button", { type: "button", class: "secondary" }, "Load older messages");
  button.addEventListener("click", async () => {
    button.disabled = true;
    try {
      const path = `/assistant/chat/${encodeURIComponent(view.chatId)}`;
      const page = await view.api.get(path, { page_token: token }, view.controller.signal);
      const messages = kept(page.messages || [], attached);
      view.history.prepend(...messageElements(messages, new Map(), view));
      olderButton(view, page.next_page_token, attached);
    } catch (error) {
      const why = error.status || "network";
      view.older.append(notice("error", `Older messages cannot be loaded (${why}).`));
      button.disabled = false;
    }
  });
  view.older.append(button);
}
