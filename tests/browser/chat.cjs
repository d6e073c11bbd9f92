'use strict';
// A chat with llama-server's own web page in headless Chromium (playwright-core driving Debian's chromium), one
// step at a time; run by tests/python/test_server_ui.py, which starts the servers and checks what this records.
//
//   node chat.cjs SPEC.json
//
// SPEC: { playwright_core: folder of the playwright-core package, chromium: the browser executable, url: the
//         server, settings: {key: value} merged into the page's stored settings (localStorage "LlamaUi.config", where
//         its Settings dialog keeps them) before the page loads, viewport?: {width, height}, timeout_ms: per wait,
//         idle_timeout_ms: from an answer or an error to an idle page, out: where the record goes (JSON),
//         steps: [{ attach?: image file, text?: message to send, screenshot?: PNG file, scroll_top?: bool }] }
// A step attaches its file (through the message box's file input, as the "+" menu's "Images" does) and waits for
// its preview in the message box or a dialog refusing it (closed again with Escape); then types its text into the
// message box and presses Enter, waits for the chat request's response (or a dialog: the page may fail before it
// sends anything), for the answer to stop changing, and then for an idle page: neither the "Processing" spinner nor
// the stop button may stay longer than idle_timeout_ms. The screenshot shows the dialog if there was one, else the
// page at the end of the step (scrolled to the conversation's start with scroll_top).
// The record: page {status, title, message_box}; per step: attach {file, preview | dialog}, status and
// content_type of the chat response, content_chunks and streamed (the parts of the answer the server streamed: how
// many, their sum), timings (its last streamed timings: prompt_n, cache_n, ...), answer_texts
// (every text the new answer's box showed while it streamed), dialog, busy; requests (the chat request bodies the
// page sent); messages (the conversation as the page stored it in IndexedDB: role, exact content, images);
// page_errors, console_errors; error: why the run stopped early (a wait that timed out: a hung page), or null.

const fs = require('fs');
const path = require('path');

const spec = JSON.parse(fs.readFileSync(process.argv[2], 'utf8'));
const { chromium } = require(path.resolve(spec.playwright_core));

const CHAT_PATH = '/v1/chat/completions';
// the message box (a textarea; the rich editor where that is turned on)
const MESSAGE_BOX = '.conversation-chat-form textarea, .chat-form-input-rich';
const record = { steps: [], requests: [], page_errors: [], console_errors: [], messages: [], error: null };

function save() {
	fs.writeFileSync(spec.out, JSON.stringify(record, null, 1));
}

// in the page, before its own scripts: the settings, and a trace of every text the last answer shows
function initPage(settings) {
	const key = 'LlamaUi.config';
	const stored = JSON.parse(localStorage.getItem(key) || '{}');
	localStorage.setItem(key, JSON.stringify({ ...stored, ...settings }));
	window.__answerTexts = [];
	const observe = () => {
		const answers = document.querySelectorAll('.chat-message-assistant');
		if (answers.length === 0) return;
		const text = answers[answers.length - 1].innerText.trim();
		const trace = window.__answerTexts;
		const last = trace[trace.length - 1];
		if (!last || last.n !== answers.length || last.text !== text) trace.push({ n: answers.length, text });
	};
	new MutationObserver(observe).observe(document, { characterData: true, childList: true, subtree: true });
}

async function storedMessages(page) {
	return page.evaluate(
		() =>
			new Promise((resolve, reject) => {
				const req = indexedDB.open('LlamaUi');
				req.onerror = () => reject(req.error);
				req.onsuccess = () => {
					const db = req.result;
					const all = db.transaction('messages').objectStore('messages').getAll();
					all.onerror = () => reject(all.error);
					all.onsuccess = () => {
						db.close();
						const msgs = all.result.filter((m) => m.role === 'user' || m.role === 'assistant');
						msgs.sort((a, b) => a.timestamp - b.timestamp);
						resolve(
							msgs.map((m) => ({
								role: m.role,
								content: m.content,
								images: (m.extra || []).filter((e) => e.type === 'IMAGE').length
							}))
						);
					};
				};
			})
	);
}

// the visible dialogs' texts
async function dialogs(page) {
	return page.locator('[role="dialog"]:visible, [role="alertdialog"]:visible').allInnerTexts();
}

async function busy(page) {
	const spinner = await page.locator('.shimmer-text:visible').count();
	const stop = await page.getByRole('button', { exact: true, name: 'Stop' }).count();
	return spinner + stop > 0;
}

async function until(what, cond, timeoutMs) {
	const deadline = Date.now() + timeoutMs;
	for (;;) {
		const v = await cond();
		if (v) return v;
		if (Date.now() > deadline) throw new Error(`timed out after ${timeoutMs} ms waiting for ${what}`);
		await new Promise((r) => setTimeout(r, 100));
	}
}

// the conversation from its start (for a screenshot of the whole chat)
async function scrollTop(page) {
	const size = page.viewportSize();
	await page.mouse.move(size.width / 2, size.height / 3);
	for (let i = 0; i < 10; i++) await page.mouse.wheel(0, -1000);
	await page.waitForTimeout(500);
}

async function attach(page, step, rec) {
	const name = path.basename(step.attach);
	const preview = page.locator(`.conversation-chat-form [aria-label="Preview ${name}"]`);
	await page.locator('input[type="file"]').first().setInputFiles(step.attach);
	// the page either shows the image in the message box or says why it cannot take it
	const outcome = await until(
		'the attachment to show up or be refused',
		async () => {
			const shown = await dialogs(page);
			if (shown.length) return { dialog: shown.join('\n') };
			return (await preview.count()) > 0 ? { preview: true } : null;
		},
		spec.timeout_ms
	);
	rec.attach = { file: name, ...outcome };
	if (outcome.dialog && step.screenshot) await page.screenshot({ path: step.screenshot });
	if (outcome.dialog) {
		await page.keyboard.press('Escape');
		await until('the dialog to close', async () => (await dialogs(page)).length === 0, spec.timeout_ms);
	}
}

async function send(page, step, rec, responses) {
	const box = page.locator(MESSAGE_BOX).first();
	await box.click();
	await page.keyboard.type(step.text);
	const answers = await page.locator('.chat-message-assistant').count();
	const sent = responses.length;
	await page.evaluate(() => (window.__answerTexts = []));
	await page.keyboard.press('Enter');
	// the server's answer, or the page saying why there is none
	await until(
		'a chat request or a message on the page',
		async () => responses.length > sent || (await dialogs(page)).length > 0,
		spec.timeout_ms
	);
	if (responses.length > sent) {
		const res = responses[sent];
		rec.status = res.status();
		rec.content_type = res.headers()['content-type'] || '';
		await res.finished();
		// a streamed answer's last timings (prompt_n: prompt tokens computed, cache_n: taken from the cache)
		const body = await res.text().catch(() => '');
		// and its text as the server streamed it: the chunks that carried a part of the answer, and their sum
		rec.content_chunks = 0;
		rec.streamed = '';
		for (const line of body.split('\n')) {
			if (!line.startsWith('data: ') || line === 'data: [DONE]') continue;
			try {
				const chunk = JSON.parse(line.slice(6));
				if (chunk.timings) rec.timings = chunk.timings;
				const part = chunk.choices && chunk.choices[0] && chunk.choices[0].delta && chunk.choices[0].delta.content;
				if (part) {
					rec.content_chunks += 1;
					rec.streamed += part;
				}
			} catch {
				// not JSON: left out
			}
		}
		if (rec.status !== 200) rec.body = body.slice(0, 2000);
	}
	// done: no spinner or stop button, and a new answer whose text stays put, or a dialog (an error)
	let last = null;
	let stableSince = 0;
	await until(
		'the page to finish the answer',
		async () => {
			if ((await dialogs(page)).length) return true;
			if (await busy(page)) return false;
			const n = await page.locator('.chat-message-assistant').count();
			if (n <= answers) return false;
			const text = await page.locator('.chat-message-assistant').last().innerText();
			if (text !== last) {
				last = text;
				stableSince = Date.now();
				return false;
			}
			return Date.now() - stableSince > 500;
		},
		spec.timeout_ms
	);
	rec.answer_texts = (await page.evaluate(() => window.__answerTexts))
		.filter((t) => t.n > answers && t.text)
		.map((t) => t.text);
	rec.dialog = (await dialogs(page)).join('\n');
	if (rec.dialog) {
		if (step.screenshot) await page.screenshot({ path: step.screenshot });
		await page.keyboard.press('Escape');
		await until('the dialog to close', async () => (await dialogs(page)).length === 0, spec.timeout_ms);
	}
	// never a spinner that stays: the page must be idle soon after the answer or the error
	await until('the page to be idle (no spinner, no stop button)', async () => !(await busy(page)), spec.idle_timeout_ms);
}

async function main() {
	const browser = await chromium.launch({
		args: ['--no-sandbox', '--disable-gpu', '--disable-dev-shm-usage'],
		executablePath: spec.chromium,
		headless: true
	});
	try {
		const context = await browser.newContext({
			colorScheme: 'light',
			viewport: spec.viewport || { height: 900, width: 1280 }
		});
		await context.addInitScript(initPage, spec.settings || {});
		const page = await context.newPage();
		page.on('pageerror', (e) => record.page_errors.push(String(e)));
		page.on('console', (m) => m.type() === 'error' && record.console_errors.push(m.text()));
		const responses = [];
		const isChat = (r) => r.method() === 'POST' && new URL(r.url()).pathname === CHAT_PATH;
		page.on('request', (r) => isChat(r) && record.requests.push(JSON.parse(r.postData() || 'null')));
		page.on('response', (r) => isChat(r.request()) && responses.push(r));
		page.setDefaultTimeout(spec.timeout_ms);

		const home = await page.goto(spec.url);
		record.page = { status: home.status(), title: await page.title() };
		if (home.status() !== 200) throw new Error(`the page answered ${home.status()}`);
		await page.locator(MESSAGE_BOX).first().waitFor({ state: 'visible' });
		record.page.message_box = true;

		for (const step of spec.steps) {
			const rec = {};
			record.steps.push(rec);
			try {
				if (step.attach) await attach(page, step, rec);
				if (step.text) await send(page, step, rec, responses);
			} catch (e) {
				record.error = `step ${record.steps.length}: ${e.message}`;
				rec.busy = await busy(page);
				if (step.screenshot) await page.screenshot({ path: step.screenshot });
				break;
			}
			rec.busy = await busy(page);
			if (step.screenshot && !(rec.attach && rec.attach.dialog) && !rec.dialog) {
				if (step.scroll_top) await scrollTop(page);
				await page.screenshot({ path: step.screenshot });
			}
		}
		record.messages = await storedMessages(page);
	} catch (e) {
		record.error = record.error || String(e && e.stack ? e.stack : e);
	} finally {
		save();
		await browser.close();
	}
}

main();
