package gateway

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"hash"

	v1 "github.com/buildq/buildq/api/v1"
)

// Request ids the gateway makes are deterministic, so that a redelivered
// event or webhook becomes the same request, which JetStream's duplicate
// window (Nats-Msg-Id) stores once, on whichever replica it lands:
//
//   - a CloudEvent whose data has no requestId:
//     "ce-" + hex(sha256("cloudevent", tenant, event source, event
//     id))[:40] — the
//     CloudEvents spec makes source + id unique per distinct event;
//   - a webhook push, for each trigger it matches:
//     "gh-" (GitHub) or "gl-" (GitLab) + hex(sha256("webhook", forge,
//     tenant, delivery, trigger))[:40], where delivery is X-GitHub-Delivery
//     (kept by GitHub's redeliveries), GitLab's Idempotency-Key or
//     X-Gitlab-Event-UUID, or, without any, the push itself (repository,
//     ref, before, after), and the trigger is what it builds (repository,
//     name, image, dockerfile, subPath, target).
//
// Each string is hashed length-prefixed, so no two lists of parts hash
// alike.

// idHexLen is how many hex digits of the digest an id keeps (160 bits).
const idHexLen = 40

func idDigest(parts ...string) string {
	h := sha256.New()
	writeParts(h, parts)
	return hex.EncodeToString(h.Sum(nil))[:idHexLen]
}

func writeParts(h hash.Hash, parts []string) {
	var n [8]byte
	for _, p := range parts {
		binary.BigEndian.PutUint64(n[:], uint64(len(p)))
		h.Write(n[:])
		h.Write([]byte(p))
	}
}

// EventRequestID is the request id of a CloudEvent of tenant whose data
// names none.
func EventRequestID(tenant, source, id string) string {
	return "ce-" + idDigest("cloudevent", tenant, source, id)
}

// hookRequestID is the request id of trigger tr's build of a webhook
// delivery; forge is "github" or "gitlab".
func hookRequestID(forge, tenant, delivery string, tr Trigger) string {
	prefix := "gh-"
	if forge == forgeGitLab {
		prefix = "gl-"
	}
	return prefix + idDigest("webhook", forge, tenant, delivery, tr.key())
}

// pushDelivery is a push's own identity, for a webhook without a delivery
// header.
func pushDelivery(p push) string {
	urls := make([]string, 0, len(p.repoURLs))
	for _, u := range p.repoURLs {
		if n := normalizeRepo(u); n != "" {
			urls = append(urls, n)
		}
	}
	repo := ""
	if len(urls) > 0 {
		repo = urls[0]
	}
	return "push:" + idDigest(repo, p.ref, p.before, p.after)
}

// nonceLen is the length of a Nats-Msg-Id nonce, in hex digits (as the
// publisher SDK's).
const nonceLen = 20

// msgID is a request's Nats-Msg-Id, v1.RequestMsgID(tenant, requestID,
// nonce) with nonce = HMAC-SHA256(key, tenant/requestID): unpredictable
// to anyone without the key (so no other tenant can publish the header
// first and have JetStream drop the request), the same on every replica
// and across retries (so a redelivery is a duplicate).
func msgID(key []byte, tenant, requestID string) string {
	m := hmac.New(sha256.New, key)
	writeParts(m, []string{"buildq-gateway-msgid", tenant, requestID})
	return v1.RequestMsgID(tenant, requestID, hex.EncodeToString(m.Sum(nil))[:nonceLen])
}
