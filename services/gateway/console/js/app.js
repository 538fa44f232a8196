// The console's shell: sign-in, the navigation and the hash router.
//
// Each view is a function (root, ctx) that fills `root` and may return a cleanup function,
// called when the user navigates away (it aborts the view's streams and timers).
// ctx = {api, me, navigate}.

import { Api, ApiError } from "./api.js";
import { renderChat, renderChats } from "./chat.js";
import { h, clear, notice, text } from "./dom.js";
import {
  renderCredentials,
  renderIntegrations,
  renderKeys,
  renderKnowledge,
  renderUsage,
} from "./panels.js";

const VIEWS = {
  chats: (root, ctx) => renderChats(root, ctx),
  chat: (root, ctx, id) => renderChat(root, ctx, id || null),
  credentials: renderCredentials,
  knowledge: renderKnowledge,
  integrations: renderIntegrations,
  keys: renderKeys,
  usage: renderUsage,
};

let cleanup = null;
let session = null; // {api, me}
let signInMessage = null; // why the sign-in form shows again (a refused key), once

/** Show view `hash`; `replace` replaces the current history entry instead of adding one (a new
 * chat's #/chat becoming #/chat/<id>: Back then leaves the chat instead of opening an empty one). */
function navigate(hash, { replace = false } = {}) {
  if (window.location.hash === hash) route();
  else if (replace) window.location.replace(hash);
  else window.location.hash = hash;
}

function route() {
  if (cleanup) {
    cleanup();
    cleanup = null;
  }
  const root = clear(document.getElementById("view"));
  if (!session) {
    renderSignIn(root, signInMessage);
    signInMessage = null;
    return;
  }
  const [name, ...rest] = window.location.hash.replace(/^#\/?/, "").split("/");
  const view = VIEWS[name] ? name : "chats";
  for (const link of document.querySelectorAll("#nav a")) {
    const current = link.dataset.nav === (view === "chat" ? "chats" : view);
    if (current) link.setAttribute("aria-current", "page");
    else link.removeAttribute("aria-current");
  }
  const id = rest.length ? decodeURIComponent(rest.join("/")) : undefined;
  try {
    cleanup = VIEWS[view](root, { ...session, navigate }, id) || null;
  } catch (error) {
    root.append(notice("error", `This page failed: ${error.message}`));
  }
  focusHeading(root);
}

/** Move the focus to the view's main heading unless the view focused a control of its own (a
 * chat's message box): a keyboard or screen reader user starts at the new page's top. */
function focusHeading(root) {
  if (root.contains(document.activeElement)) return;
  const heading = root.querySelector("h1");
  if (!heading) return;
  heading.tabIndex = -1;
  heading.focus({ preventScroll: true });
}

/** Forget the session and show the sign-in form with `message`: a request was refused with 401
 * (the key was revoked or expired while signed in). */
function signOut(message) {
  Api.forget();
  session = null;
  signInMessage = message;
  showSession();
  route();
}

/** The sign-in form's words for a key refused with 401. */
function refusedKey(error) {
  return `Your API key was refused (401): ${String(error.detail).replace(/\.$/, "")}. Sign in again.`;
}

/** `api` signed in as `me`: a 401 to any of its later requests signs out. */
function signIn(api, me) {
  api.onUnauthorized = (error) => {
    if (session && session.api === api) {
      signOut(refusedKey(error));
    }
  };
  session = { api, me };
}

// Zero-width and other invisible characters a paste can bring around a key or an id.
const INVISIBLE = "\\s\\u200B-\\u200D\\u2060\\uFEFF";
const EDGES = new RegExp(`^[${INVISIBLE}]+|[${INVISIBLE}]+$`, "gu");

/** `value` without white space and zero-width characters at either end. */
function trimmed(value) {
  return String(value).replace(EDGES, "");
}

/** Why `value` cannot be sent in an HTTP header (the API key and the organization id are
 * headers: visible ASCII only), or null when it can. */
function unsendable(label, value) {
  if (!value) return `Enter the ${label}.`;
  const bad = [...value].find((c) => c < "!" || c > "~");
  if (bad === undefined) return null;
  const code = `U+${bad.codePointAt(0).toString(16).toUpperCase().padStart(4, "0")}`;
  return (
    `The ${label} can hold only visible ASCII characters (letters, digits, punctuation); ` +
    `it has ${code} at position ${[...value].indexOf(bad) + 1}. Check what was pasted.`
  );
}

function showSession() {
  const signedIn = Boolean(session);
  document.getElementById("nav").hidden = !signedIn;
  document.getElementById("sign-out").hidden = !signedIn;
  const who = document.getElementById("who");
  who.replaceChildren(
    ...(signedIn
      ? [
          text(session.me.email || session.me.id),
          " · ",
          text(session.api.organizationId),
          session.me.role ? ` (${session.me.role})` : "",
        ]
      : []),
  );
}

/** Check `api` against GET /auth/me; the profile, or throws ApiError. */
async function whoAmI(api) {
  return api.get("/auth/me");
}

function renderSignIn(root, message) {
  const key = h("input", { type: "password", name: "api_key", required: true, autocomplete: "off" });
  const org = h("input", { type: "text", name: "organization_id", required: true });
  const status = h("div", { class: "status" }, message ? notice("error", message) : null);
  const form = h(
    "form",
    { class: "card sign-in", id: "sign-in" },
    h("h1", {}, "Sign in"),
    h("p", { class: "hint" }, "Kept in this tab only; closing the tab forgets it."),
    h("label", {}, "API key", key),
    h("label", {}, "Organization id", org),
    h("button", { type: "submit" }, "Sign in"),
    status,
  );
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const api = new Api(trimmed(key.value), trimmed(org.value));
    clear(status);
    const wrong = unsendable("API key", api.apiKey) || unsendable("organization id", api.organizationId);
    if (wrong) {
      status.append(notice("error", wrong));
      return;
    }
    try {
      const me = await whoAmI(api);
      api.save();
      signIn(api, me);
      showSession();
      navigate(window.location.hash && window.location.hash !== "#/" ? window.location.hash : "#/chats");
    } catch (error) {
      const text =
        error instanceof ApiError ? `${error.status}: ${error.detail}` : "The gateway cannot be reached.";
      status.append(notice("error", text));
    }
  });
  root.append(form);
  key.focus();
}

async function start() {
  document.getElementById("sign-out").addEventListener("click", () => {
    Api.forget();
    session = null;
    showSession();
    navigate("#/");
  });
  window.addEventListener("hashchange", route);
  const api = Api.load();
  if (api) {
    try {
      signIn(api, await whoAmI(api));
    } catch (error) {
      Api.forget();
      session = null;
      if (error instanceof ApiError && error.status === 401) {
        signInMessage = refusedKey(error);
      }
    }
  }
  showSession();
  route();
}

start();
