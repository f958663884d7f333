/*
 * sparkgpu._jpeg: fused JPEG decode + crop + resize + flip into a preallocated uint8 batch.
 *
 * RandomResizedCrop on a JPEG usually keeps part of the image and shrinks it: decoding the
 * whole image first and cropping after is wasted work. libjpeg-turbo decodes only a region:
 *   jpeg_crop_scanline   the columns around the box (widened to whole iMCU columns);
 *   jpeg_skip_scanlines  past the rows above the box, then stop after its last row;
 *   scale_denom 2/4/8    decodes at 1/2, 1/4 or 1/8 size in the IDCT, used only while the
 *                        scaled box still has at least as many pixels as the output in both
 *                        dimensions (twice as many for 1/8), so that what the resize sees stays
 *                        close to full decoding.
 * The region is then resized with antialiasing, as PIL's BILINEAR reduce and torchvision's
 * antialias=True do (a triangle filter widened by the downscale factor, taps precomputed once
 * per image, 14-bit fixed-point weights, SSE2 where the CPU has it), vertically then
 * horizontally, on the RGBX pixels libjpeg-turbo writes; the horizontal pass
 * writes each output row straight into the (n, 3, H, W) batch, mirrored where asked.
 *
 * The extension does not link against libjpeg: load() dlopen()s the library path Python hands
 * it (Pillow's bundled libjpeg-turbo, or a system libjpeg.so.62) and dlsym()s the few functions
 * it needs; the struct layouts come from the libjpeg 6.2 ABI headers vendored in native/jpeg/.
 *
 * libjpeg's default error handler calls exit(). Here a fatal error longjmp()s back to the image
 * being decoded, whose position and message are returned to Python (which raises DataError);
 * data that ends before the rows the crop needs is a fatal error too. Warnings about corrupt
 * entropy-coded data are silent and decoding goes on as libjpeg recovers, as Pillow and
 * torchvision do. The GIL is released while decoding; a batch is shared among POSIX threads,
 * each with its own decompress struct and buffers, taking images one at a time from a counter.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <pthread.h>
#include <setjmp.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#if defined(__SSE2__) && defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_AVX2_DISPATCH 1
#else
#define HAVE_AVX2_DISPATCH 0
#endif

#include "jpeglib.h"

#define MAX_THREADS 64
/* Below this many images a batch is decoded by the calling thread. */
#define PARALLEL_MIN_IMAGES 2
/* Fixed-point weights: 14 fractional bits keep a weight of 1.0 inside an int16 lane. */
#define PRECISION_BITS 14
/* Bytes read or written past a row's end by the 16- and 32-byte vector loops. */
#define SLACK 32
#define MESSAGE_BYTES 256
/* Columns decoded past each side of a box, for the chroma upsampler's neighbours. */
#define CHROMA_MARGIN 2

/* What went wrong with an image, as Python maps it to an exception. */
enum { FAIL_NONE = 0, FAIL_DATA = 1, FAIL_BOX = 2, FAIL_MEMORY = 3 };

/* ------------------------------------------------------------------------------------------ */
/* The library, resolved at run time.                                                          */

typedef struct {
    struct jpeg_error_mgr *(*std_error)(struct jpeg_error_mgr *);
    void (*create_decompress)(j_decompress_ptr, int, size_t);
    void (*destroy_decompress)(j_decompress_ptr);
    void (*abort_decompress)(j_decompress_ptr);
    int (*read_header)(j_decompress_ptr, boolean);
    boolean (*start_decompress)(j_decompress_ptr);
    JDIMENSION (*read_scanlines)(j_decompress_ptr, JSAMPARRAY, JDIMENSION);
    JDIMENSION (*skip_scanlines)(j_decompress_ptr, JDIMENSION);
    void (*crop_scanline)(j_decompress_ptr, JDIMENSION *, JDIMENSION *);
    boolean (*resync_to_restart)(j_decompress_ptr, int);
} JpegApi;

static JpegApi api;
static void *library = NULL;

/* ------------------------------------------------------------------------------------------ */
/* One decoder per thread: the decompress struct, its error and source managers, buffers.    */

typedef struct {
    struct jpeg_error_mgr pub;
    jmp_buf jump;
    char message[JMSG_LENGTH_MAX];
} ErrorManager;

typedef struct {
    int *start, *count;  /* first input index and number of taps, per output index */
    int16_t *weights;    /* ksize fixed-point weights per output index */
    int ksize;
    size_t start_capacity, count_capacity, weights_capacity;
} Taps;

typedef struct {
    struct jpeg_decompress_struct cinfo;
    ErrorManager err;
    struct jpeg_source_mgr src;
    int created;
    uint8_t *pixels;     /* the decoded region, rows of `stride` bytes */
    size_t pixels_capacity;
    JSAMPROW *rows;
    size_t rows_capacity;
    uint8_t *line;       /* one vertically resized row */
    size_t line_capacity;
    Taps tx, ty;
} Decoder;

static void fail_now(j_decompress_ptr cinfo, const char *message) {
    ErrorManager *err = (ErrorManager *)cinfo->err;
    snprintf(err->message, sizeof(err->message), "%s", message);
    longjmp(err->jump, 1);
}

static void on_error_exit(j_common_ptr cinfo) {
    ErrorManager *err = (ErrorManager *)cinfo->err;
    err->pub.format_message(cinfo, err->message);
    longjmp(err->jump, 1);
}

/* Warnings (corrupt entropy data, extraneous bytes) are counted by libjpeg, never printed. */
static void on_output_message(j_common_ptr cinfo) { (void)cinfo; }

static void source_init(j_decompress_ptr cinfo) { (void)cinfo; }
static void source_term(j_decompress_ptr cinfo) { (void)cinfo; }

/* The whole JPEG is in the buffer from the start: being asked for more means it is cut short. */
static boolean source_fill(j_decompress_ptr cinfo) {
    fail_now(cinfo, "the data ends before the image does (a truncated file?)");
    return FALSE;
}

static void source_skip(j_decompress_ptr cinfo, long num_bytes) {
    struct jpeg_source_mgr *src = cinfo->src;
    if (num_bytes <= 0) return;
    if ((size_t)num_bytes > src->bytes_in_buffer) source_fill(cinfo);
    src->next_input_byte += num_bytes;
    src->bytes_in_buffer -= (size_t)num_bytes;
}

/* Grows *buffer to hold at least `need` items of `size` bytes; 0 on success. */
static int reserve(void **buffer, size_t *capacity, size_t need, size_t size) {
    if (need <= *capacity) return 0;
    size_t grown = need + need / 4;
    void *p = realloc(*buffer, grown * size);
    if (!p) return -1;
    *buffer = p;
    *capacity = grown;
    return 0;
}

static int decoder_open(Decoder *d) {
    memset(d, 0, sizeof(*d));
    d->cinfo.err = api.std_error(&d->err.pub);
    d->err.pub.error_exit = on_error_exit;
    d->err.pub.output_message = on_output_message;
    if (setjmp(d->err.jump)) return -1; /* the library's struct has another size: another ABI */
    api.create_decompress(&d->cinfo, JPEG_LIB_VERSION, sizeof(d->cinfo));
    d->created = 1;
    d->src.init_source = source_init;
    d->src.fill_input_buffer = source_fill;
    d->src.skip_input_data = source_skip;
    d->src.resync_to_restart = api.resync_to_restart;
    d->src.term_source = source_term;
    d->cinfo.src = &d->src;
    return 0;
}

static void taps_free(Taps *t) {
    free(t->start);
    free(t->count);
    free(t->weights);
}

static void decoder_close(Decoder *d) {
    if (d->created) api.destroy_decompress(&d->cinfo);
    free(d->pixels);
    free(d->rows);
    free(d->line);
    taps_free(&d->tx);
    taps_free(&d->ty);
    d->created = 0;
}

/* ------------------------------------------------------------------------------------------ */
/* Antialiased resize: PIL's precompute_coeffs with the bilinear (triangle) filter.           */

static double triangle(double x) {
    if (x < 0.0) x = -x;
    return x < 1.0 ? 1.0 - x : 0.0;
}

/* Taps mapping the input interval [in0, in1) of an axis of in_size pixels onto out_size
 * pixels; the filter is cut at the axis' ends (as PIL does) and renormalised. 0 on success. */
static int taps_make(Taps *t, double in0, double in1, int in_size, int out_size) {
    double scale = (in1 - in0) / out_size;
    double filterscale = scale < 1.0 ? 1.0 : scale;
    double support = filterscale; /* the triangle's support is 1 */
    int reach = (int)support;
    if (reach < support) reach++;
    const int ksize = (reach * 2 + 2) & ~1; /* PIL's ceil(support) * 2 + 1, made even: SSE2 reads pairs */
    if (reserve((void **)&t->start, &t->start_capacity, (size_t)out_size, sizeof(int)) ||
        reserve((void **)&t->count, &t->count_capacity, (size_t)out_size, sizeof(int)) ||
        reserve((void **)&t->weights, &t->weights_capacity, (size_t)out_size * (size_t)ksize, sizeof(int16_t)))
        return -1;
    t->ksize = ksize;
    double ss = 1.0 / filterscale, k[64];
    double *kk = ksize <= 64 ? k : malloc(sizeof(double) * (size_t)ksize);
    if (!kk) return -1;
    for (int xx = 0; xx < out_size; xx++) {
        double center = in0 + (xx + 0.5) * scale;
        int xmin = (int)(center - support + 0.5);
        if (xmin < 0) xmin = 0;
        int xmax = (int)(center + support + 0.5);
        if (xmax > in_size) xmax = in_size;
        xmax -= xmin;
        if (xmax > ksize) xmax = ksize;
        if (xmax < 1) { /* a box narrower than the rounding: take its nearest pixel */
            xmin = (int)center < in_size ? (int)center : in_size - 1;
            xmax = 1;
            kk[0] = 1.0;
        } else {
            double ww = 0.0;
            for (int x = 0; x < xmax; x++) {
                double w = triangle((x + xmin - center + 0.5) * ss);
                kk[x] = w;
                ww += w;
            }
            if (ww == 0.0) {
                xmax = 1;
                kk[0] = 1.0;
            } else {
                for (int x = 0; x < xmax; x++) kk[x] /= ww;
            }
        }
        t->start[xx] = xmin;
        t->count[xx] = xmax;
        int16_t *w = t->weights + (size_t)xx * (size_t)ksize;
        for (int x = 0; x < xmax; x++) w[x] = (int16_t)(kk[x] * (1 << PRECISION_BITS) + 0.5);
        for (int x = xmax; x < ksize; x++) w[x] = 0;
    }
    if (kk != k) free(kk);
    return 0;
}

#if defined(__SSE2__)
static inline __m128i load32(const uint8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm_cvtsi32_si128(v);
}

/* Weights k and k + 1 as the two int16 halves of an int32 (x86 is little-endian). */
static inline int32_t weight_pair(const int16_t *w) {
    int32_t v;
    memcpy(&v, w, 4);
    return v;
}
#else
static inline uint8_t clip8(int32_t v) {
    v >>= PRECISION_BITS;
    return (uint8_t)(v < 0 ? 0 : v > 255 ? 255 : v);
}
#endif

/* Vertical taps over `count` region rows `stride` bytes apart: `width` bytes of each, into one
 * output row. The vector versions take the taps two at a time, each pair of rows interleaved
 * into 16-bit lanes for madd (as Pillow-SIMD does); rows and `line` have SLACK bytes of slack. */
typedef void (*VerticalPass)(const uint8_t *pixels, size_t stride, const int16_t *weights, int count, uint8_t *line,
                             int width);

#if defined(__SSE2__)
static void resize_vertical_sse2(const uint8_t *pixels, size_t stride, const int16_t *weights, int count,
                                 uint8_t *line, int width) {
    const __m128i zero = _mm_setzero_si128(), half = _mm_set1_epi32(1 << (PRECISION_BITS - 1));
    for (int j = 0; j < width; j += 16) {
        __m128i s0 = half, s1 = half, s2 = half, s3 = half;
        for (int k = 0; k < count; k += 2) {
            const uint8_t *row = pixels + (size_t)k * stride + j;
            __m128i a = _mm_loadu_si128((const __m128i *)row);
            __m128i b = k + 1 < count ? _mm_loadu_si128((const __m128i *)(row + stride)) : zero;
            __m128i w = _mm_set1_epi32(weight_pair(weights + k));
            __m128i lo = _mm_unpacklo_epi8(a, b), hi = _mm_unpackhi_epi8(a, b);
            s0 = _mm_add_epi32(s0, _mm_madd_epi16(_mm_unpacklo_epi8(lo, zero), w));
            s1 = _mm_add_epi32(s1, _mm_madd_epi16(_mm_unpackhi_epi8(lo, zero), w));
            s2 = _mm_add_epi32(s2, _mm_madd_epi16(_mm_unpacklo_epi8(hi, zero), w));
            s3 = _mm_add_epi32(s3, _mm_madd_epi16(_mm_unpackhi_epi8(hi, zero), w));
        }
        s0 = _mm_srai_epi32(s0, PRECISION_BITS);
        s1 = _mm_srai_epi32(s1, PRECISION_BITS);
        s2 = _mm_srai_epi32(s2, PRECISION_BITS);
        s3 = _mm_srai_epi32(s3, PRECISION_BITS);
        _mm_storeu_si128((__m128i *)(line + j), _mm_packus_epi16(_mm_packs_epi32(s0, s1), _mm_packs_epi32(s2, s3)));
    }
}
#endif

#if HAVE_AVX2_DISPATCH
/* The SSE2 loop on 32 bytes: AVX2's unpacks and packs work within 128-bit lanes, so each lane
 * comes out in the same order as the SSE2 version's register. Chosen at import where the CPU
 * has AVX2. */
__attribute__((target("avx2"))) static void resize_vertical_avx2(const uint8_t *pixels, size_t stride,
                                                                 const int16_t *weights, int count, uint8_t *line,
                                                                 int width) {
    const __m256i zero = _mm256_setzero_si256(), half = _mm256_set1_epi32(1 << (PRECISION_BITS - 1));
    for (int j = 0; j < width; j += 32) {
        __m256i s0 = half, s1 = half, s2 = half, s3 = half;
        for (int k = 0; k < count; k += 2) {
            const uint8_t *row = pixels + (size_t)k * stride + j;
            __m256i a = _mm256_loadu_si256((const __m256i *)row);
            __m256i b = k + 1 < count ? _mm256_loadu_si256((const __m256i *)(row + stride)) : zero;
            __m256i w = _mm256_set1_epi32(weight_pair(weights + k));
            __m256i lo = _mm256_unpacklo_epi8(a, b), hi = _mm256_unpackhi_epi8(a, b);
            s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(_mm256_unpacklo_epi8(lo, zero), w));
            s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(_mm256_unpackhi_epi8(lo, zero), w));
            s2 = _mm256_add_epi32(s2, _mm256_madd_epi16(_mm256_unpacklo_epi8(hi, zero), w));
            s3 = _mm256_add_epi32(s3, _mm256_madd_epi16(_mm256_unpackhi_epi8(hi, zero), w));
        }
        s0 = _mm256_srai_epi32(s0, PRECISION_BITS);
        s1 = _mm256_srai_epi32(s1, PRECISION_BITS);
        s2 = _mm256_srai_epi32(s2, PRECISION_BITS);
        s3 = _mm256_srai_epi32(s3, PRECISION_BITS);
        _mm256_storeu_si256((__m256i *)(line + j),
                            _mm256_packus_epi16(_mm256_packs_epi32(s0, s1), _mm256_packs_epi32(s2, s3)));
    }
}
#endif

#if !defined(__SSE2__)
static void resize_vertical_scalar(const uint8_t *pixels, size_t stride, const int16_t *weights, int count,
                                   uint8_t *line, int width) {
    for (int j = 0; j < width; j++) {
        int32_t sum = 1 << (PRECISION_BITS - 1);
        for (int k = 0; k < count; k++) sum += weights[k] * (int32_t)pixels[(size_t)k * stride + j];
        line[j] = clip8(sum);
    }
}
static VerticalPass resize_vertical = resize_vertical_scalar;
#else
static VerticalPass resize_vertical = resize_vertical_sse2; /* PyInit__jpeg picks AVX2 where it can */
#endif

/* Horizontal taps over one row of RGBX pixels into three planes, mirrored when `flip`. */
#if defined(__SSE2__)
/* A pixel's four channels in one register, two taps per _mm_madd_epi16. Every output pixel
 * takes `pairs` pairs (its weights are zero past its count), so with `pairs` a constant the
 * loop unrolls; the row has zeroed slack for the taps past its end. */
static inline __attribute__((always_inline)) __m128i horizontal_pixel(const uint8_t *s, const int16_t *w,
                                                                      const int pairs) {
    const __m128i zero = _mm_setzero_si128();
    __m128i sum = _mm_set1_epi32(1 << (PRECISION_BITS - 1));
    for (int k = 0; k < pairs; k++, s += 8) {
        __m128i pair = _mm_unpacklo_epi8(_mm_unpacklo_epi8(load32(s), load32(s + 4)), zero);
        sum = _mm_add_epi32(sum, _mm_madd_epi16(pair, _mm_set1_epi32(weight_pair(w + 2 * k))));
    }
    return _mm_srai_epi32(sum, PRECISION_BITS);
}

static inline void store32(uint8_t *p, __m128i v) {
    int32_t x = _mm_cvtsi128_si32(v);
    memcpy(p, &x, 4);
}

/* Four output pixels at a time: their RGBX bytes transposed to RRRR GGGG BBBB (two unpacks)
 * make one 4-byte store per plane. */
static inline __attribute__((always_inline)) void horizontal_pairs(const uint8_t *line, const Taps *t, int out_w,
                                                                   int flip, uint8_t *r, uint8_t *g, uint8_t *b,
                                                                   const int pairs) {
    const int16_t *w = t->weights;
    const int *start = t->start;
    int xx = 0;
    for (; xx + 4 <= out_w; xx += 4, w += 8 * pairs) {
        __m128i p0 = horizontal_pixel(line + 4 * start[xx], w, pairs);
        __m128i p1 = horizontal_pixel(line + 4 * start[xx + 1], w + 2 * pairs, pairs);
        __m128i p2 = horizontal_pixel(line + 4 * start[xx + 2], w + 4 * pairs, pairs);
        __m128i p3 = horizontal_pixel(line + 4 * start[xx + 3], w + 6 * pairs, pairs);
        __m128i v = flip ? _mm_packus_epi16(_mm_packs_epi32(p3, p2), _mm_packs_epi32(p1, p0))
                         : _mm_packus_epi16(_mm_packs_epi32(p0, p1), _mm_packs_epi32(p2, p3));
        v = _mm_unpacklo_epi8(v, _mm_unpackhi_epi64(v, v));
        v = _mm_unpacklo_epi8(v, _mm_unpackhi_epi64(v, v));
        const int x = flip ? out_w - 4 - xx : xx;
        store32(r + x, v);
        store32(g + x, _mm_srli_si128(v, 4));
        store32(b + x, _mm_srli_si128(v, 8));
    }
    for (; xx < out_w; xx++, w += 2 * pairs) {
        __m128i p = horizontal_pixel(line + 4 * start[xx], w, pairs);
        uint32_t rgbx = (uint32_t)_mm_cvtsi128_si32(_mm_packus_epi16(_mm_packs_epi32(p, p), p));
        const int x = flip ? out_w - 1 - xx : xx;
        r[x] = (uint8_t)rgbx;
        g[x] = (uint8_t)(rgbx >> 8);
        b[x] = (uint8_t)(rgbx >> 16);
    }
}

static void resize_horizontal(const uint8_t *line, const Taps *t, int out_w, int flip, uint8_t *r, uint8_t *g,
                              uint8_t *b) {
    switch (t->ksize / 2) { /* 1 pair when upscaling, 2 up to a 1.5x reduce, 3 up to 2.5x, ... */
    case 1: horizontal_pairs(line, t, out_w, flip, r, g, b, 1); break;
    case 2: horizontal_pairs(line, t, out_w, flip, r, g, b, 2); break;
    case 3: horizontal_pairs(line, t, out_w, flip, r, g, b, 3); break;
    case 4: horizontal_pairs(line, t, out_w, flip, r, g, b, 4); break;
    default: horizontal_pairs(line, t, out_w, flip, r, g, b, t->ksize / 2);
    }
}
#else
static void resize_horizontal(const uint8_t *line, const Taps *t, int out_w, int flip, uint8_t *r, uint8_t *g,
                              uint8_t *b) {
    for (int xx = 0; xx < out_w; xx++) {
        const uint8_t *s = line + 4 * t->start[xx];
        const int16_t *w = t->weights + (size_t)xx * (size_t)t->ksize;
        int32_t sr = 1 << (PRECISION_BITS - 1), sg = sr, sb = sr;
        for (int k = 0, n = t->count[xx]; k < n; k++, s += 4) {
            sr += w[k] * s[0];
            sg += w[k] * s[1];
            sb += w[k] * s[2];
        }
        const int x = flip ? out_w - 1 - xx : xx;
        r[x] = clip8(sr);
        g[x] = clip8(sg);
        b[x] = clip8(sb);
    }
}
#endif

/* ------------------------------------------------------------------------------------------ */
/* One image.                                                                                  */

typedef struct {
    const uint8_t **data;
    const Py_ssize_t *lengths;
    const int32_t *boxes; /* (top, left, height, width) per image */
    const uint8_t *flips;
    uint8_t *out;
    int out_h, out_w;
    Py_ssize_t n;
    Py_ssize_t next; /* the next image a thread takes (atomic) */
    pthread_mutex_t lock;
    Py_ssize_t error_index; /* the first failed image, n when none */
    int error_kind;
    char error_message[MESSAGE_BYTES];
} Batch;

static void record_failure(Batch *b, Py_ssize_t index, int kind, const char *message) {
    pthread_mutex_lock(&b->lock);
    if (index < b->error_index) {
        b->error_index = index;
        b->error_kind = kind;
        snprintf(b->error_message, sizeof(b->error_message), "%s", message);
    }
    pthread_mutex_unlock(&b->lock);
}

/* Adobe CMYK JPEGs store inverted ink, so R = C * K / 255 (as torchvision converts them). */
static void cmyk_rows_to_rgbx(uint8_t *pixels, size_t stride, int rows, int width) {
    for (int y = 0; y < rows; y++) {
        uint8_t *p = pixels + (size_t)y * stride;
        for (int x = 0; x < width; x++, p += 4) {
            int k = p[3];
            p[0] = (uint8_t)(p[0] * k / 255);
            p[1] = (uint8_t)(p[1] * k / 255);
            p[2] = (uint8_t)(p[2] * k / 255);
        }
    }
}

/* Decodes image i into its slot of the batch; FAIL_NONE or what went wrong, with a message. */
static int decode_one(Decoder *d, Batch *b, Py_ssize_t i, char *message) {
    j_decompress_ptr c = &d->cinfo;
    const int32_t *box = b->boxes + 4 * i;
    const int64_t top = box[0], left = box[1], bh = box[2], bw = box[3];
    const int out_h = b->out_h, out_w = b->out_w;
    if (setjmp(d->err.jump)) {
        api.abort_decompress(c);
        snprintf(message, MESSAGE_BYTES, "%s", d->err.message);
        return FAIL_DATA;
    }
    d->src.next_input_byte = b->data[i];
    d->src.bytes_in_buffer = (size_t)b->lengths[i];
    api.read_header(c, TRUE);
    const int64_t height = c->image_height, width = c->image_width;
    if (top < 0 || left < 0 || bh < 1 || bw < 1 || top + bh > height || left + bw > width) {
        api.abort_decompress(c);
        snprintf(message, MESSAGE_BYTES,
                 "box (top=%lld, left=%lld, height=%lld, width=%lld) is not inside the %lldx%lld image (width x height)",
                 (long long)top, (long long)left, (long long)bh, (long long)bw, (long long)width, (long long)height);
        return FAIL_BOX;
    }
    /* RGBX: four bytes a pixel let the resize handle a pixel's channels in one register. */
    const int cmyk = c->jpeg_color_space == JCS_CMYK || c->jpeg_color_space == JCS_YCCK;
    c->out_color_space = cmyk ? JCS_CMYK : JCS_EXT_RGBX;
    /* IDCT scaling. 1/2 and 1/4 (4x4 and 2x2 IDCTs) while the scaled box keeps at least the
     * output's pixels: 40-54 and 35-50 dB PSNR against full decoding on test photos. 1/8 keeps
     * only each block's mean, which aliases (26-30 dB) unless the resize after it still halves
     * (35-38 dB): only while the scaled box keeps twice the output's pixels. */
    int denom = 1;
    for (int scale = 8; scale >= 2; scale >>= 1) {
        const int64_t need = scale == 8 ? 2 : 1;
        if (bh / scale >= need * out_h && bw / scale >= need * out_w) {
            denom = scale;
            break;
        }
    }
    c->scale_num = 1;
    c->scale_denom = (unsigned int)denom;
    api.start_decompress(c);

    /* The box in the scaled image: whole pixels [x0, x1) x [y0, y1) around it. */
    const int64_t ow = c->output_width, oh = c->output_height;
    int64_t x0 = left / denom, x1 = (left + bw + denom - 1) / denom;
    int64_t y0 = top / denom, y1 = (top + bh + denom - 1) / denom;
    if (x1 > ow) x1 = ow;
    if (y1 > oh) y1 = oh;
    /* Fancy (smooth) chroma upsampling treats a partial row's ends as the image's ends, so the
     * decoded columns reach CHROMA_MARGIN past the box on each side: the box's own columns then
     * match a full decode. crop_scanline moves the start left to an iMCU column. */
    const int64_t cx0 = x0 > CHROMA_MARGIN ? x0 - CHROMA_MARGIN : 0;
    const int64_t cx1 = x1 + CHROMA_MARGIN < ow ? x1 + CHROMA_MARGIN : ow;
    JDIMENSION crop_x = (JDIMENSION)cx0, crop_w = (JDIMENSION)(cx1 - cx0);
    if (cx0 > 0 || cx1 < ow) api.crop_scanline(c, &crop_x, &crop_w);
    else crop_w = (JDIMENSION)ow;
    const size_t stride = (size_t)crop_w * 4;
    const int region_h = (int)(y1 - y0), region_w = (int)(x1 - x0);
    const int shift = (int)(x0 - (int64_t)crop_x);
    /* The box relative to the region, in (scaled) pixel coordinates. */
    const double fx0 = (double)left / denom - (double)x0, fy0 = (double)top / denom - (double)y0;
    if (taps_make(&d->tx, fx0, fx0 + (double)bw / denom, region_w, out_w) ||
        taps_make(&d->ty, fy0, fy0 + (double)bh / denom, region_h, out_h)) {
        api.abort_decompress(c);
        return FAIL_MEMORY;
    }
    /* Slack past the region's last row and the line's last pixel, zeroed: the vector loops read
     * it (the horizontal pass up to a whole kernel past the end), always with zero weights. */
    const size_t pixels_bytes = stride * (size_t)region_h, line_bytes = (size_t)region_w * 4;
    const size_t line_slack = 4 * (size_t)d->tx.ksize + SLACK;
    if (reserve((void **)&d->pixels, &d->pixels_capacity, pixels_bytes + SLACK, 1) ||
        reserve((void **)&d->rows, &d->rows_capacity, (size_t)region_h, sizeof(JSAMPROW)) ||
        reserve((void **)&d->line, &d->line_capacity, line_bytes + line_slack, 1)) {
        api.abort_decompress(c);
        return FAIL_MEMORY;
    }
    memset(d->pixels + pixels_bytes, 0, SLACK);
    memset(d->line + line_bytes, 0, line_slack);
    for (int y = 0; y < region_h; y++) d->rows[y] = d->pixels + (size_t)y * stride;
    const size_t plane = (size_t)out_h * (size_t)out_w;
    uint8_t *r = b->out + (size_t)i * 3 * plane, *g = r + plane, *bl = g + plane;
    const int flip = b->flips[i] != 0;
    const uint8_t *first = d->pixels + (size_t)shift * 4;

    /* Each output row is resized as soon as the rows under its taps are decoded, while they are
     * still in cache. */
    if (y0 > 0) api.skip_scanlines(c, (JDIMENSION)y0);
    int decoded = 0, yy = 0;
    while (decoded < region_h) {
        if (api.read_scanlines(c, d->rows + decoded, (JDIMENSION)(region_h - decoded)) == 0) break;
        int upto = (int)(c->output_scanline - (JDIMENSION)y0);
        if (cmyk) cmyk_rows_to_rgbx(d->pixels + (size_t)decoded * stride, stride, upto - decoded, (int)crop_w);
        decoded = upto;
        for (; yy < out_h && d->ty.start[yy] + d->ty.count[yy] <= decoded; yy++) {
            resize_vertical(first + (size_t)d->ty.start[yy] * stride, stride,
                            d->ty.weights + (size_t)yy * (size_t)d->ty.ksize, d->ty.count[yy], d->line,
                            region_w * 4);
            size_t row = (size_t)yy * (size_t)out_w;
            resize_horizontal(d->line, &d->tx, out_w, flip, r + row, g + row, bl + row);
        }
    }
    api.abort_decompress(c); /* the rows below the box are never decoded */
    if (yy < out_h) {
        snprintf(message, MESSAGE_BYTES, "the decoder stopped after %d of the box's %d rows", decoded, region_h);
        return FAIL_DATA;
    }
    return FAIL_NONE;
}

static void decode_range(Batch *b) {
    Decoder d;
    char message[MESSAGE_BYTES];
    if (decoder_open(&d) < 0) {
        Py_ssize_t i = __atomic_fetch_add(&b->next, 1, __ATOMIC_RELAXED);
        if (i < b->n) record_failure(b, i, FAIL_DATA, d.err.message);
        decoder_close(&d);
        return;
    }
    for (;;) {
        Py_ssize_t i = __atomic_fetch_add(&b->next, 1, __ATOMIC_RELAXED);
        if (i >= b->n) break;
        int kind = decode_one(&d, b, i, message);
        if (kind == FAIL_MEMORY) snprintf(message, sizeof(message), "out of memory");
        if (kind != FAIL_NONE) record_failure(b, i, kind, message);
    }
    decoder_close(&d);
}

static void *decode_range_thread(void *arg) {
    decode_range((Batch *)arg);
    return NULL;
}

static void run_batch(Batch *b, int threads) {
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > b->n) threads = (int)b->n;
    if (threads <= 1 || b->n < PARALLEL_MIN_IMAGES) {
        decode_range(b);
        return;
    }
    pthread_t tids[MAX_THREADS];
    int started[MAX_THREADS];
    for (int t = 1; t < threads; t++) started[t] = pthread_create(&tids[t], NULL, decode_range_thread, b) == 0;
    decode_range(b); /* a thread that failed to start leaves its images to the others */
    for (int t = 1; t < threads; t++) {
        if (started[t]) pthread_join(tids[t], NULL);
    }
}

/* ------------------------------------------------------------------------------------------ */
/* Python functions.                                                                           */

typedef struct {
    Py_buffer *views;
    const uint8_t **ptrs;
    Py_ssize_t *lens;
    Py_ssize_t count;
} Items;

static void release_items(Items *s) {
    for (Py_ssize_t i = 0; i < s->count; i++) PyBuffer_Release(&s->views[i]);
    PyMem_Free(s->views);
    PyMem_Free(s->ptrs);
    PyMem_Free(s->lens);
    memset(s, 0, sizeof(*s));
}

/* Buffers of every item of a sequence of bytes-like objects; n is checked when >= 0. */
static int acquire_items(PyObject *seq, Items *s, Py_ssize_t n) {
    memset(s, 0, sizeof(*s));
    PyObject *fast = PySequence_Fast(seq, "encoded must be a sequence of bytes-like objects");
    if (!fast) return -1;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(fast);
    if (n >= 0 && count != n) {
        PyErr_Format(PyExc_ValueError, "%zd encoded images for %zd boxes", count, n);
        Py_DECREF(fast);
        return -1;
    }
    s->views = PyMem_Calloc((size_t)count + 1, sizeof(Py_buffer));
    s->ptrs = PyMem_Calloc((size_t)count + 1, sizeof(uint8_t *));
    s->lens = PyMem_Calloc((size_t)count + 1, sizeof(Py_ssize_t));
    if (!s->views || !s->ptrs || !s->lens) {
        Py_DECREF(fast);
        release_items(s);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(fast, i), &s->views[i], PyBUF_SIMPLE) < 0) {
            Py_DECREF(fast);
            release_items(s);
            return -1;
        }
        s->count = i + 1;
        s->ptrs[i] = (const uint8_t *)s->views[i].buf;
        s->lens[i] = s->views[i].len;
    }
    Py_DECREF(fast);
    return 0;
}

static PyObject *load(PyObject *self, PyObject *args) {
    const char *path;
    if (!PyArg_ParseTuple(args, "s", &path)) return NULL;
    if (library) Py_RETURN_NONE;
    void *handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!handle) {
        const char *why = dlerror();
        PyErr_Format(PyExc_OSError, "cannot load %s: %s", path, why ? why : "unknown error");
        return NULL;
    }
    JpegApi found;
    struct {
        void **slot;
        const char *name;
    } symbols[] = {
        {(void **)&found.std_error, "jpeg_std_error"},
        {(void **)&found.create_decompress, "jpeg_CreateDecompress"},
        {(void **)&found.destroy_decompress, "jpeg_destroy_decompress"},
        {(void **)&found.abort_decompress, "jpeg_abort_decompress"},
        {(void **)&found.read_header, "jpeg_read_header"},
        {(void **)&found.start_decompress, "jpeg_start_decompress"},
        {(void **)&found.read_scanlines, "jpeg_read_scanlines"},
        {(void **)&found.skip_scanlines, "jpeg_skip_scanlines"},
        {(void **)&found.crop_scanline, "jpeg_crop_scanline"},
        {(void **)&found.resync_to_restart, "jpeg_resync_to_restart"},
    };
    for (size_t k = 0; k < sizeof(symbols) / sizeof(symbols[0]); k++) {
        *symbols[k].slot = dlsym(handle, symbols[k].name);
        if (!*symbols[k].slot) {
            PyErr_Format(PyExc_OSError,
                         "%s does not export %s: it is not libjpeg-turbo 1.5 or newer with the libjpeg 6.2 ABI",
                         path, symbols[k].name);
            dlclose(handle);
            return NULL;
        }
    }
    api = found;
    /* A decompress struct of another size (another ABI) fails here, not later. */
    Decoder d;
    if (decoder_open(&d) < 0) {
        PyErr_Format(PyExc_OSError, "%s is not a libjpeg 6.2 ABI library: %s", path, d.err.message);
        decoder_close(&d);
        dlclose(handle);
        memset(&api, 0, sizeof(api));
        return NULL;
    }
    decoder_close(&d);
    library = handle;
    Py_RETURN_NONE;
}

static PyObject *loaded(PyObject *self, PyObject *args) { return PyBool_FromLong(library != NULL); }

static PyObject *decode_crops(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"out", "encoded", "boxes", "flips", "height", "width", "threads", NULL};
    PyObject *out_obj, *encoded_obj, *boxes_obj, *flips_obj;
    int out_h, out_w, threads = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOii|i", kwlist, &out_obj, &encoded_obj, &boxes_obj,
                                     &flips_obj, &out_h, &out_w, &threads))
        return NULL;
    if (!library) {
        PyErr_SetString(PyExc_RuntimeError, "no libjpeg is loaded: call load(path) first");
        return NULL;
    }
    if (out_h < 1 || out_w < 1) {
        PyErr_SetString(PyExc_ValueError, "height and width must be positive");
        return NULL;
    }
    Py_buffer out = {0}, boxes = {0}, flips = {0};
    Items items;
    PyObject *result = NULL;
    if (PyObject_GetBuffer(boxes_obj, &boxes, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    Py_ssize_t n = boxes.len / 16;
    if (boxes.len % 16 != 0) {
        PyErr_SetString(PyExc_ValueError, "boxes must hold 4 int32 per image");
        goto done_boxes;
    }
    if (PyObject_GetBuffer(flips_obj, &flips, PyBUF_C_CONTIGUOUS) < 0) goto done_boxes;
    if (flips.len != n) {
        PyErr_SetString(PyExc_ValueError, "flips must hold one byte per image");
        goto done_flips;
    }
    if (acquire_items(encoded_obj, &items, n) < 0) goto done_flips;
    if (PyObject_GetBuffer(out_obj, &out, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) goto done_items;
    if (out.len != n * 3 * (Py_ssize_t)out_h * out_w) {
        PyErr_Format(PyExc_ValueError, "out holds %zd bytes, the batch needs %zd", out.len,
                     n * 3 * (Py_ssize_t)out_h * out_w);
        goto done_out;
    }
    Batch b;
    memset(&b, 0, sizeof(b));
    b.data = items.ptrs;
    b.lengths = items.lens;
    b.boxes = (const int32_t *)boxes.buf;
    b.flips = (const uint8_t *)flips.buf;
    b.out = (uint8_t *)out.buf;
    b.out_h = out_h;
    b.out_w = out_w;
    b.n = n;
    b.error_index = n;
    pthread_mutex_init(&b.lock, NULL);
    Py_BEGIN_ALLOW_THREADS
    run_batch(&b, threads);
    Py_END_ALLOW_THREADS
    pthread_mutex_destroy(&b.lock);
    if (b.error_index < n)
        result = Py_BuildValue("(nis)", b.error_index, b.error_kind, b.error_message);
    else
        result = Py_NewRef(Py_None);
done_out:
    PyBuffer_Release(&out);
done_items:
    release_items(&items);
done_flips:
    PyBuffer_Release(&flips);
done_boxes:
    PyBuffer_Release(&boxes);
    return result;
}

/* (height, width) from the frame header (SOF0..SOF15 but DHT, JPG, DAC); NULL and a message
 * when there is none before the image data or the data ends first. */
static const char *frame_size(const uint8_t *p, Py_ssize_t len, int32_t *height, int32_t *width) {
    if (len < 4 || p[0] != 0xFF || p[1] != 0xD8) return "does not start with a JPEG SOI marker (FF D8)";
    Py_ssize_t pos = 2;
    for (;;) {
        while (pos < len && p[pos] != 0xFF) pos++; /* garbage between segments, as libjpeg skips it */
        while (pos < len && p[pos] == 0xFF) pos++; /* fill bytes */
        if (pos >= len) return "ends before its frame header (truncated?)";
        const int marker = p[pos++];
        if (marker == 0xD8 || marker == 0x01 || (marker >= 0xD0 && marker <= 0xD7)) continue;
        if (marker == 0xD9 || marker == 0xDA) return "has no frame header before its image data";
        if (pos + 2 > len) return "ends before its frame header (truncated?)";
        const int length = (p[pos] << 8) | p[pos + 1];
        if (length < 2) return "has a marker segment of a bad length";
        if (marker >= 0xC0 && marker <= 0xCF && marker != 0xC4 && marker != 0xC8 && marker != 0xCC) {
            if (length < 7 || pos + 7 > len) return "ends inside its frame header (truncated?)";
            *height = (p[pos + 3] << 8) | p[pos + 4];
            *width = (p[pos + 5] << 8) | p[pos + 6];
            if (*height == 0 || *width == 0) return "has a frame header with a zero height or width";
            return NULL;
        }
        pos += length;
    }
}

static PyObject *jpeg_sizes(PyObject *self, PyObject *args) {
    PyObject *out_obj, *encoded_obj;
    if (!PyArg_ParseTuple(args, "OO", &out_obj, &encoded_obj)) return NULL;
    Items items;
    Py_buffer out = {0};
    PyObject *result = NULL;
    if (acquire_items(encoded_obj, &items, -1) < 0) return NULL;
    if (PyObject_GetBuffer(out_obj, &out, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) goto done_items;
    if (out.len != items.count * 8) {
        PyErr_SetString(PyExc_ValueError, "out must hold 2 int32 per image");
        goto done_out;
    }
    int32_t *sizes = (int32_t *)out.buf;
    for (Py_ssize_t i = 0; i < items.count; i++) {
        const char *why = frame_size(items.ptrs[i], items.lens[i], sizes + 2 * i, sizes + 2 * i + 1);
        if (why) {
            result = Py_BuildValue("(ns)", i, why);
            goto done_out;
        }
    }
    result = Py_NewRef(Py_None);
done_out:
    PyBuffer_Release(&out);
done_items:
    release_items(&items);
    return result;
}

static PyMethodDef methods[] = {
    {"load", load, METH_VARARGS,
     "load(path)\n\nLoads the libjpeg (6.2 ABI, libjpeg-turbo 1.5 or newer) at path; OSError if it cannot."},
    {"loaded", loaded, METH_NOARGS, "loaded() -> bool: whether load() succeeded."},
    {"decode_crops", (PyCFunction)(void (*)(void))decode_crops, METH_VARARGS | METH_KEYWORDS,
     "decode_crops(out, encoded, boxes, flips, height, width, threads=1)\n\n"
     "Decodes box (top, left, height, width) of each JPEG (int32 boxes, uint8 flips), resizes it to\n"
     "(height, width) with antialiasing, mirrors it where flips[i], and writes RGB planes into the\n"
     "uint8 buffer out of n * 3 * height * width bytes. Returns None, or (index, kind, message)\n"
     "for the first image that failed (kind 1: bad data, 2: box outside the image, 3: memory)."},
    {"jpeg_sizes", jpeg_sizes, METH_VARARGS,
     "jpeg_sizes(out, encoded)\n\nWrites (height, width) of each JPEG into the int32 buffer out (2 per\n"
     "image) from its frame header. Returns None, or (index, message) for the first that has none."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "sparkgpu._jpeg",
    "Fused JPEG region decode + antialiased resize + flip into a uint8 batch (libjpeg loaded at run time).", -1,
    methods,
};

PyMODINIT_FUNC PyInit__jpeg(void) {
#if HAVE_AVX2_DISPATCH
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2")) resize_vertical = resize_vertical_avx2;
#endif
    return PyModule_Create(&module);
}
