// The chats list: the caller's chats, newest first, with their state, and "New chat".
//
// The list gives only `is_running`; a chat that is not running is asked its status
// (GET /assistant/chat/{id}/status) to tell "awaiting input" from "ended (<latest run's status>)".

import { ApiError } from "./api.js";
import { h, notice, text, when } from "./dom.js";

const PAGE = 20;

/** "Refused (402) [code]: reason" from a failed request, or the network's failure. */
export function refusal(error) {
  if (error instanceof ApiError) {
    const body = error.body;
    const code = body && typeof body.code === "string" ? ` [${body.code}]` : "";
    return `Refused (${error.status})${code}: ${error.detail}`;
  }
  return "The gateway cannot be reached.";
}

/** [class, text] of a chat's state from its status route's answer. */
function stateOf(status) {
  if (status.awaiting_input) return ["awaiting", "awaiting input"];
  if (status.is_running) return ["running", "running"];
  const latest = status.run_status && status.run_status.status;
  return ["ended", latest ? `ended (${latest})` : "ended"];
}

/** A chat's state badge from its list item and, when not running, its status route. */
function stateBadge(api, item, signal) {
  const badge = h("span", { class: "badge chat-state" }, item.is_running ? "running" : "…");
  if (item.is_running) {
    badge.classList.add("running");
    return badge;
  }
  api.get(`/assistant/chat/${encodeURIComponent(item.id)}/status`, {}, signal).then(
    (status) => {
      const [cls, text] = stateOf(status);
      badge.className = `badge chat-state ${cls}`;
      badge.textContent = text;
    },
    () => {
      if (!signal.aborted) badge.textContent = "?";
    },
  );
  return badge;
}

/** One row of the list. */
function chatRow(api, item, signal) {
  const link = h(
    "a",
    { href: `#/chat/${encodeURIComponent(item.id)}`, class: "chat-link" },
    item.title ? text(item.title) : "(untitled)",
  );
  return h(
    "tr",
    { class: "chat-row", dataset: { chatId: item.id } },
    h("td", {}, link),
    h("td", {}, stateBadge(api, item, signal)),
    h("td", { class: "muted" }, when(item.created_at)),
  );
}

/** The organization's chats, newest first, with their state; "New chat". */
export function renderChats(root, ctx) {
  const controller = new AbortController();
  const signal = controller.signal;
  const rows = h("tbody", {});
  const more = h("button", { type: "button", class: "secondary", hidden: true }, "Load more");
  const status = h("div", {});
  let cursor = null;
  const load = async () => {
    more.disabled = true;
    try {
      const page = await ctx.api.get("/assistant/chats", { limit: PAGE, cursor }, signal);
      for (const item of page.items || []) rows.append(chatRow(ctx.api, item, signal));
      cursor = page.next_cursor || null;
      more.hidden = !cursor;
      if (!rows.children.length) {
        rows.append(h("tr", {}, h("td", { colspan: "3", class: "muted" }, "No chats yet.")));
      }
    } catch (error) {
      if (!signal.aborted) status.replaceChildren(notice("error", refusal(error)));
    }
    more.disabled = false;
  };
  more.addEventListener("click", load);
  const start = h("button", { type: "button", class: "new-chat" }, "New chat");
  start.addEventListener("click", () => ctx.navigate("#/chat"));
  // the list is ordered by when each chat was created (newest first): the column shows that
  const head = h("tr", {}, h("th", {}, "Chat"), h("th", {}, "State"), h("th", {}, "Started"));
  root.append(
    h("div", { class: "row page-head" }, h("h1", { class: "grow" }, "Chats"), start),
    h(
      "div",
      { class: "card" },
      h("div", { class: "table-wrap" }, h("table", { class: "chats" }, h("thead", {}, head), rows)),
      more,
      status,
    ),
  );
  load();
  return () => controller.abort();
}
